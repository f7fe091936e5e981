"""Token ids -> text deltas for streaming responses: incremental detokenization that never splits
a multi-byte character, and a hold-back so a stop string is never sent before it is recognised."""
from specee_core.step.stops import StopMatcher


class IncrementalDecoder:
    """Decode a growing token list into text deltas.

    Decoding one token alone is wrong for byte-level BPE (a character can span tokens, and
    tokenizers drop or add spaces at piece boundaries), so each step decodes a short window of
    recent tokens and emits what it adds beyond the window's already-emitted prefix. A window that
    ends in U+FFFD is an incomplete UTF-8 sequence: wait for the next token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens up to here have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        done = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done) :]
        return ""


class StreamText:
    """One choice's streamed text: decoded deltas, held back by (longest stop string - 1)
    characters so a stop string split across tokens is cut before any of it is sent."""

    def __init__(self, tokenizer, stop: tuple[str, ...] | list[str] = ()):
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = StopMatcher(stop)
        self.text = ""  # decoded so far (cut at a stop string once one is seen)
        self.sent = 0  # characters of self.text already sent
        self.stopped = False

    def push(self, token_id: int) -> str:
        """The delta that is safe to send after this token ("" when nothing is)."""
        if self.stopped:
            return ""
        self.text += self.decoder.push(token_id)
        safe = len(self.text) - self.stops.overlap  # the last characters may begin a stop string
        if (cut := self.stops.update(self.text)) >= 0:
            self.text, self.stopped = self.text[:cut], True
            safe = cut
        return self._take(safe)

    def finish(self, final_text: str) -> str:
        """The rest of the text once generation is over; final_text (the engine's) is authoritative."""
        if final_text.startswith(self.text[: self.sent]):
            self.text = final_text
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : upto], upto
        return delta
