"""Text around the engine: tokenizing prompts, incremental detokenizing, stop strings.

Used by the gateway and by the offline ``pagedserve.llm.LLM``; imports no service.
"""
