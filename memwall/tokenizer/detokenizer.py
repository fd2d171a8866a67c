"""Streaming detokenization: token ids in, text deltas out, stop strings found on the way.

Decoding one token at a time is wrong in two ways. A character can span several tokens (an emoji
is four byte tokens in a byte-level vocabulary), so a lone token decodes to U+FFFD; and decoders
of SentencePiece vocabularies strip the leading space of the *first* token they see, so "▁world"
alone decodes to "world". The fix is the prefix/read offset technique: decode a short window of
tokens that starts a little before the new ones, and hand out only what the new ones add, once it
no longer ends in U+FFFD. The window starts in the prompt, so the first output token keeps the
space it carries after the prompt. One more rule for SentencePiece byte tokens (<0xE6>): their
decoder turns a whole *run* of them into U+FFFDs when the run is not valid UTF-8, so a window
never ends inside such a run; text there waits for the next ordinary token.

Contract, for the final state:
    output_text == decode(prompt_tail + output_ids)[len(decode(prompt_tail)):]   (cut at a stop string)
which is `decode(output_ids)` except that a SentencePiece-style first token keeps its leading space.
The concatenation of all `get_delta` results equals `output_text`.
"""

from __future__ import annotations

from collections.abc import Sequence

from memwall.tokenizer.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded together with the first output tokens, for spacing context. A handful is
# enough: merges and byte sequences never reach further back than a few tokens.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never contain broken UTF-8 or wrong
    spaces mid-stream, and finds stop strings."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._byte_ids = tokenizer.byte_fallback_token_ids
        self._special_ids = tokenizer.special_token_ids
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if self._decode(self._ids).endswith(REPLACEMENT_CHAR) or self._ends_in_byte_token():
            # The prompt ends inside a character (or a run of byte tokens the output could
            # extend): text offsets would not line up, so decode the output on its own instead.
            self._ids = []
        # _ids[_prefix:_read] is already turned into text; _ids[_read:] is not yet.
        self._prefix = 0
        self._read = len(self._ids)
        self._text = ""
        self._sent = 0  # how much of _text get_delta has handed out
        self._matched_stop: str | None = None
        self._flushed = False

    # -- public API -------------------------------------------------------------------------

    @property
    def output_text(self) -> str:
        """All text so far (cut at the stop string, when one matched)."""
        return self._text

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._matched_stop

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append tokens; return the stop string that now appears in the text, else None.

        On a match the text is cut right before the stop string (right after it with
        include_stop_str_in_output) and later calls are ignored: the request is over.
        """
        if self._matched_stop is not None or self._flushed or not new_token_ids:
            return None
        self._ids.extend(int(i) for i in new_token_ids)
        return self._append(self._advance(final=False))

    def get_delta(self, finished: bool) -> str:
        """Text not handed out yet.

        While not finished, a tail that could still grow into a stop string is held back (it
        would have to be taken back if it did). When finished, everything left is returned,
        including the text of a trailing incomplete character (as U+FFFD, like `decode`).
        """
        if finished and self._matched_stop is None and not self._flushed:
            self._flushed = True
            self._append(self._advance(final=True))
        end = len(self._text)
        if not finished and self._matched_stop is None:
            end -= self._stop_prefix_len()
        delta = self._text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return delta

    # -- decoding ---------------------------------------------------------------------------

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _advance(self, final: bool) -> str:
        """New text from the undecoded tokens, or "" while it would end in a partial character."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text):
            return ""  # e.g. only skipped special tokens so far
        if not final and (full_text.endswith(REPLACEMENT_CHAR) or self._ends_in_byte_token()):
            # The last character is not complete yet; or the text ends in SentencePiece byte
            # tokens, which the next byte token can still turn into U+FFFD all together.
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text) :]

    def _ends_in_byte_token(self) -> bool:
        """Whether the last token the decoder sees is a SentencePiece byte token."""
        if not self._byte_ids:
            return False
        for token_id in reversed(self._ids):
            if not (self._skip_special and token_id in self._special_ids):
                return token_id in self._byte_ids
        return False

    # -- stop strings -----------------------------------------------------------------------

    def _append(self, new_text: str) -> str | None:
        """Add text, then look for stop strings where they could newly appear."""
        if not new_text:
            return None
        old_len = len(self._text)
        self._text += new_text
        found = self._find_stop(old_len)
        if found is None:
            return None
        stop, start = found
        self._matched_stop = stop
        self._text = self._text[: start + len(stop) if self._include_stop else start]
        return stop

    def _find_stop(self, old_len: int) -> tuple[str, int] | None:
        """(stop, start) of the stop string that completes first in the text after `old_len`.

        Searching from len(stop)-1 characters before the new text finds stops split across
        updates. "Completes first" (earliest end, then the longest) gives the same answer no
        matter how the text was chunked into updates.
        """
        best: tuple[int, int, str, int] | None = None
        for stop in self._stops:
            start = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if start >= 0:
                key = (start + len(stop), -len(stop), stop, start)
                best = key if best is None or key < best else best
        return None if best is None else (best[2], best[3])

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
