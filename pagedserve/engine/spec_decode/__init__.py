"""Speculative decoding (issue #23): proposers that draft tokens, and the rejection sampler that
verifies them in one target step."""
