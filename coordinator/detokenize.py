"""Incremental detokenisation of one choice's tokens, with stop strings.

Tokens arrive in batches; text must go out as soon as it is certain. `Detokenizer` decodes a
sliding window of token ids (the tokens of the last emitted piece plus the new ones, as vLLM
does) and emits the new text only when it does not end in U+FFFD: a multi-byte character split
across tokens is held back until its last byte arrives (or the choice ends, when whatever is
left is flushed as the tokenizer renders it). Stop strings are searched in the emitted text;
the first match cuts the text before the stop string, and `push` reports how many of the
offered tokens it took, so the caller trims the token ids to the token that completed the
stop string: the same cut the engine makes (it checks the decoded output after every token).
Before `min_tokens` tokens no stop string counts (vLLM's rule, the engine's too). While a stop
string could still be forming, its last len(stop)-1 characters are held back
from streaming, so streamed deltas never need retracting. The concatenated deltas equal the
final `text` by construction, so streaming and non-streaming answers agree exactly.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class Detokenizer:
    """One choice's text. tokenizer: anything with decode(ids) -> str."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0):
        self.tok = tokenizer
        self.stop = tuple(stop)
        self.min_tokens = min_tokens  # stop strings count only from this many tokens on (as the engine)
        self.ids: list[int] = []
        self.text = ""            # settled text (cut before the stop string once one matched)
        self.stopped = False      # a stop string matched; later tokens are refused
        self._sent = 0            # characters of `text` already handed out by take()
        self._prefix = 0          # window start: tokens before it are settled and out of context
        self._read = 0            # tokens whose text is already in `text`
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def push(self, token_ids) -> int:
        """Feed tokens in order; returns how many were taken (fewer when a stop string completes)."""
        for k, t in enumerate(token_ids):
            if self.stopped:
                return k
            self.ids.append(int(t))
            self._settle(final=False)
        return len(token_ids)

    def finish(self) -> None:
        """The choice ended: flush held-back text (an unfinished character renders as U+FFFD)."""
        if not self.stopped:
            self._settle(final=True)

    def take(self, final: bool = False) -> str:
        """Text not yet handed out that can no longer change (all of it once final or stopped)."""
        end = len(self.text) if final or self.stopped else max(self._sent, len(self.text) - self._hold)
        out = self.text[self._sent:end]
        self._sent = end
        return out

    def _settle(self, final: bool) -> None:
        before = self.tok.decode(self.ids[self._prefix:self._read])
        window = self.tok.decode(self.ids[self._prefix:])
        if not final and (len(window) <= len(before) or window.endswith(REPLACEMENT)):
            return  # nothing new, or a character still incomplete: wait for more tokens
        old = len(self.text)
        self.text += window[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self._check_stop(max(0, old - self._hold))

    def _check_stop(self, start: int) -> None:
        if len(self.ids) < self.min_tokens:
            return
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i != -1]
        if hits:
            self.text = self.text[:min(hits)]
            self._sent = min(self._sent, len(self.text))
            self.stopped = True
