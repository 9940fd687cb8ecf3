"""The worker's grammar matchers: one per sequence with a structured output, and the token mask they make.

A matcher (llguidance's ``LLMatcher``) knows which tokens may come next; it advances with each
token the sequence samples. It is rebuilt, never shipped: a sequence the worker gets in full (new,
recomputed after preemption, swapped back in, a forked sample, or resumed on another worker or
scheduler) replays the output tokens the plan carries (:meth:`GrammarCompiler.matcher`).

Building a matcher compiles the grammar (25-45 ms for a large JSON schema on 2 CPU cores, holding
the GIL); a pristine matcher per spec is cached under the spec's hash (``cache_key``) to copy. The
engine asks for the build before it admits a request (:meth:`GrammarCompiler.prepare`, a thread of
its own; vLLM's requests likewise wait for their grammar in the queue), so a step's model thread
finds it built; llguidance builds lexer and parser states lazily while it computes masks.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.engine.request_errors import InvalidRequestError
from pagedserve.engine.structured_output import GrammarError, StructuredOutput
from pagedserve.engine.token_bitmask import allocate_bitmask, apply_bitmask

log = logging.getLogger("pagedserve.worker")


@functools.lru_cache(maxsize=4)
def llguidance_tokenizer(tokenizer_path: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """llguidance's view of a vocabulary (``LLTokenizer``, read-only and shared by its matchers), built
    once per process for these arguments: ~0.5 CPU-s, which every offline engine built again in one
    process (the test suite's some hundred) would otherwise spend again."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer_path, n_vocab=vocab_size, eos_token=list(eos_token_ids))


def built() -> Future[None]:
    """A future that is already done: nothing to build."""
    done: Future[None] = Future()
    done.set_result(None)
    return done


class GrammarCompiler:
    """Builds matchers for one model's vocabulary.

    Args:
        tokenizer_path: the model's ``tokenizer.json``.
        vocab_size: width of the model's logits (may exceed the tokenizer's ids).
        eos_token_ids: the model's EOS ids: allowed where the grammar accepts, and alone once it ended.
        cache_size: pristine matchers kept, least recently used dropped first; as many specs that did not
            build are remembered with their error, so sending one again costs no second compile.
    """

    def __init__(self, tokenizer_path: str | Path, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = 128) -> None:
        self.tokenizer_path = str(tokenizer_path)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._pristine: OrderedDict[str, object] = OrderedDict()
        self._failed: OrderedDict[str, str] = OrderedDict()  # cache key -> why its grammar did not build
        self._building: dict[str, Future] = {}  # cache key -> its build on the compile thread (-> the pristine)
        self._lock = threading.Lock()  # guards the three: the model thread reads, the compile thread writes
        # llguidance's view of the vocabulary takes about half a second: built in the background from
        # the start, so that the first structured request does not stall a step for it
        builder = ThreadPoolExecutor(1, thread_name_prefix="grammar-vocabulary")
        self._tokenizer = builder.submit(self._build_tokenizer)
        builder.shutdown(wait=False)  # its thread ends with the build
        self._compile_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    def _build_tokenizer(self):
        return llguidance_tokenizer(self.tokenizer_path, self.vocab_size, tuple(self.eos_token_ids))

    def _llg_tokenizer(self):
        """llguidance's view of the vocabulary (waits for its build, started with the compiler)."""
        return self._tokenizer.result()

    def prepare(self, structure: StructuredOutput) -> Future:
        """Builds ``structure``'s pristine matcher on the compile thread, unless it is cached or
        being built; returns the build's future (done at once for a cached spec, or one that did not
        build before; its result is the pristine matcher, which callers outside this class ignore).

        The future raises :class:`GrammarError` if the grammar does not build.
        """
        key = structure.cache_key
        with self._lock:
            if key in self._pristine:
                return built()
            if key in self._failed:
                failed: Future = Future()
                failed.set_exception(GrammarError(self._failed[key]))
                return failed
            if key not in self._building:
                self._building[key] = self._compile_thread.submit(self._build_then_forget, structure)
            return self._building[key]

    def _build_then_forget(self, structure: StructuredOutput):
        """:meth:`_build` on the compile thread, then no longer under way whatever its outcome. (Not a
        done-callback: one added to a build that had already failed ran at once, in the thread that
        held the lock it takes, and deadlocked the compiler and the worker's steps.)"""
        try:
            return self._build(structure)
        finally:
            with self._lock:
                self._building.pop(structure.cache_key, None)

    def matcher(self, structure: StructuredOutput, output_token_ids: Sequence[int] = ()):
        """A matcher for ``structure`` that has consumed ``output_token_ids`` (a replay). Copies the
        cached pristine matcher; waits for its build if one is under way, builds it here if not
        (a spec nobody prepared: a resumed request, a worker that joined after its admission).

        Raises:
            GrammarError: the grammar does not build (replayed tokens that do not match leave the
                matcher in its error state: see :func:`advance`).
        """
        key = structure.cache_key
        with self._lock:
            pristine = self._pristine.get(key)
            building = self._building.get(key)
            failed = self._failed.get(key)
            if pristine is not None:
                self._pristine.move_to_end(key)
        if failed is not None:
            raise GrammarError(failed)
        if pristine is None:
            pristine = building.result() if building is not None else self._build(structure)
        matcher = pristine.deep_copy()
        for token_id in output_token_ids:
            advance(matcher, token_id)
        return matcher

    def _build(self, structure: StructuredOutput):
        """Builds, caches and returns ``structure``'s pristine matcher (on any thread; GrammarError
        if it fails, remembered for the spec)."""
        try:
            pristine = self._new_pristine(structure)
        except GrammarError as exc:
            self._remember(self._failed, structure.cache_key, str(exc))
            raise
        self._remember(self._pristine, structure.cache_key, pristine)
        return pristine

    def _remember(self, cache: OrderedDict, key: str, value: object) -> None:
        """Keeps ``key -> value`` in ``cache`` (``_pristine`` or ``_failed``), dropping the least recently
        used past ``cache_size``."""
        with self._lock:
            cache[key] = value
            while len(cache) > self.cache_size:
                cache.popitem(last=False)

    def _new_pristine(self, structure: StructuredOutput):
        import llguidance

        try:
            grammar = structure.grammar()
        except InvalidRequestError as exc:
            raise GrammarError(f"structured output does not build: {exc}") from None
        pristine = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if pristine.is_error():
            raise GrammarError(f"structured output does not build: {pristine.get_error()}")
        # its first mask builds the lexer states every copy starts from (up to ~30 ms for a large
        # schema): here, off the step, so that a copy's first mask takes ~0.1 ms
        scratch = allocate_bitmask(1, self.vocab_size)
        fill_mask(pristine, scratch[0])
        return pristine


def advance(matcher, token_id: int) -> None:
    """Feeds a sampled token to ``matcher`` (nothing once the grammar has ended: what follows is
    EOS, which the scheduler stops at, or tokens past ``ignore_eos``).

    A token the matcher refuses (a replayed output that does not match, or a grammar past
    llguidance's limits) leaves it in its error state, where it allows only EOS: the token drawn
    next carries the error (:func:`failure`), which ends the sequence; nothing else in the step fails.
    """
    if not follow(matcher, token_id):
        log.warning("a structured output's grammar refused token %d (%s); the sequence ends with an error",
                    token_id, matcher.get_error()[:200])


def failure(matcher) -> str | None:
    """Why ``matcher`` (or ``None``) is in its error state, where it allows only EOS; ``None`` if
    it is not: the first line of llguidance's message, which names the limit or the refused token."""
    if matcher is None or not matcher.is_error():
        return None
    return "the structured output's grammar failed: " + matcher.get_error().splitlines()[0][:300]


@dataclass(frozen=True)
class DraftMasks:
    """A structured output's masks along a speculating sequence's drafts (:func:`draft_masks`).

    Attributes:
        bitmask: CPU int32 ``[d + 1, W]``: row ``j`` the tokens allowed after the first ``j`` drafts
            (every token allowed in the rows past a draft its row refuses: never reached).
        failures: per row, :func:`failure` of the matcher at that row (what the token chosen there carries).
    """

    bitmask: torch.Tensor
    failures: tuple[str | None, ...]


def draft_masks(matcher, draft_token_ids: Sequence[int], vocab_size: int) -> DraftMasks:
    """The masks plain decoding would apply at a drafted sequence's ``d + 1`` rows had it sampled the
    drafts: the matcher's as it is, then after each draft its row allows (:func:`advance`'s rule, on a
    copy: ``matcher`` is not changed, and nothing is logged for a draft that may be rejected). A row's
    refused draft is never accepted, and a row whose matcher has failed ends the sequence, so the rows
    after either are not reached and are left unmasked."""
    bitmask = allocate_bitmask(len(draft_token_ids) + 1, vocab_size)      # (d + 1, W)
    failures: list[str | None] = []
    path = matcher.deep_copy()
    for j, view in enumerate(bitmask):
        fill_mask(path, view)
        failures.append(failure(path))
        if failures[-1] is not None or j == len(draft_token_ids) or not allows(view, draft_token_ids[j]):
            break  # the sequence ends at this row's token, or the draft is refused: no later row is reached
        follow(path, draft_token_ids[j])
    failures += [None] * (len(bitmask) - len(failures))
    return DraftMasks(bitmask, tuple(failures))


def follow(path, token_id: int) -> bool:
    """:func:`advance` without its warning, for a copy of a matcher walking drafts, which may yet be
    rejected (a token the copy refuses leaves it failed, which the next mask shows): feeds ``token_id``
    unless the grammar has ended; False when the matcher refused it."""
    return path.is_stopped() or path.consume_token(token_id)


def fill_mask(matcher, row: torch.Tensor) -> None:
    """Writes the tokens ``matcher`` allows next into ``row``, one bitmask row (CPU int32 ``[W]``)."""
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


def forced_tokens(matcher, limit: int) -> list[int]:
    """At most ``limit`` tokens ``matcher`` forces next, whatever the model would say (a JSON schema's next
    key and its quotes, say: llguidance's fast-forward tokens, those whose tokenization cannot be otherwise);
    none for ``None``, a matcher whose grammar has ended or failed, or a choice still open."""
    if matcher is None or limit <= 0 or matcher.is_stopped() or matcher.is_error():
        return []
    return list(matcher.compute_ff_tokens()[:limit])


def allows(row: torch.Tensor, token_id: int) -> bool:
    """Whether a bitmask row (int32 ``[W]``) allows ``token_id``."""
    return 0 <= token_id < row.numel() * 32 and bool((int(row[token_id // 32]) >> (token_id % 32)) & 1)


def mask_grammar(logits: torch.Tensor, matchers: Sequence[object | None]) -> None:
    """Sets to ``-inf`` (in place) every token the row's matcher does not allow next; rows without
    a matcher are untouched and cost nothing (no bitmask when no row has one).

    Args:
        logits: float32 ``[N, V]``.
        matchers: per row, its matcher or ``None``.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    bitmask = allocate_bitmask(len(rows), logits.shape[1])                # (R, W) int32
    for k, row in enumerate(rows):
        view = bitmask[k]
        fill_mask(matchers[row], view)
    apply_bitmask_rows(logits, rows, bitmask)


def apply_bitmask_rows(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """:func:`~pagedserve.engine.token_bitmask.apply_bitmask` of ``bitmask`` (CPU int32 ``[R, W]``) to
    the rows ``rows`` (``R`` indices) of ``logits`` (float32 ``[N, V]``), in place."""
    if len(rows) == logits.shape[0]:
        apply_bitmask(logits, bitmask)
        return
    index = torch.tensor(rows, device=logits.device)                      # (R,)
    sub = logits[index]                                                   # (R, V)
    apply_bitmask(sub, bitmask)
    logits[index] = sub


def grammar_compiler_for(model_path: str | Path) -> GrammarCompiler:
    """The compiler of a Hugging Face model folder (its ``tokenizer.json``, vocabulary size and EOS ids)."""
    from pagedserve.engine.model_info import load_model_info

    info = load_model_info(model_path)
    return GrammarCompiler(Path(model_path) / "tokenizer.json", info.vocab_size, info.eos_token_ids)
