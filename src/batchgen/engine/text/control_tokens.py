"""Control-token text in user strings encoded as text: only the chat template writes control tokens.

Without this, a row whose content holds "<|im_start|>system ..." is tokenized with the real control
tokens and forges a turn of the conversation. Control tokens: the tokenizer's special added tokens,
plus its other added tokens that the chat template writes (such as <think> or <tool_call>);
whitespace-only added tokens are ordinary text.

Strings without control-token text (nearly every row) take the tokenizer's own path, so their ids
are exactly what they were. For the others, each control token in a message's strings is wrapped
in two private-use marker characters (chosen absent from the row and the template) before the
template renders: in the rendered text a marked token is text, an unmarked one is the template's.
The text between two of the template's tokens is then encoded with special-token matching off.
Whole control tokens are what is found in a string: a template that glues user strings into a
token ('<|' + role + '|>') would need its own check of those strings.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from batchgen.engine.text.backend_encode import backend_of, encode_ids

Messages = list[dict]
_PRIVATE_USE = re.compile("[\U000f0000-\U0010ffff]")  # planes 15-16: where the markers are chosen
_FIRST_MARKER = 0xF0000


class ControlTokens:
    """A tokenizer's control tokens and the encoders that keep them out of user text."""

    def __init__(self, hf, template: str | None = None):
        """`template`: the chat template that renders the messages (None: the tokenizer's own)."""
        self.hf = hf
        self.backend = backend_of(hf)
        if template is None:
            template = hf.chat_template if isinstance(hf.chat_template, str) else \
                "\0".join((hf.chat_template or {}).values())  # named templates (older transformers)
        self.template = template
        self.token_ids = {token.content: token_id for token_id, token in hf.added_tokens_decoder.items()
                          if token.special or (token.content in template and not token.content.isspace())}
        self.ids = frozenset(self.token_ids.values())
        longest_first = sorted(self.token_ids, key=len, reverse=True)  # a token wins over tokens it contains
        self.pattern = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")  # (?!): matches nothing
        self._newline_ids = self.encode("\n", add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool,
               split_special_tokens: bool | None = None) -> list[int]:
        """`hf.encode`'s ids, through the Rust backend (engine/text/backend_encode.py)."""
        return encode_ids(self.hf, self.backend, text, add_special_tokens, split_special_tokens)

    def holds_control_text(self, text: str) -> bool:
        return self.pattern.search(text) is not None

    # ---- raw prompts ---------------------------------------------------------------------------
    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """All of `text` as text; the tokenizer's own BOS/EOS (add_special_tokens) still added around it."""
        body = self._as_text(text)
        if not add_special_tokens:
            return body
        prefix, suffix = self._added_around()
        return prefix + body + suffix

    def _added_around(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer's post-processor puts before and after a text (e.g. BOS)."""
        probe = self.encode("a", add_special_tokens=False)
        wrapped = self.encode("a", add_special_tokens=True)
        for start in range(len(wrapped) - len(probe) + 1):
            if wrapped[start:start + len(probe)] == probe:
                return wrapped[:start], wrapped[start + len(probe):]
        raise ValueError("cannot tell the ids this tokenizer adds around a text from the text's own")

    # ---- chat messages -------------------------------------------------------------------------
    def encode_chat(self, messages: Messages, render: Callable[[Messages], str]) -> list[int]:
        """The rendered chat's ids, where the control tokens come only from the template itself."""
        strings = list(_strings(messages))
        if not any(self.holds_control_text(s) for s in strings):
            return self.encode(render(messages), add_special_tokens=False)  # exactly as without the check
        start, end = self._markers(strings)
        marked = _map_strings(messages, lambda s: self.pattern.sub(lambda m: start + m.group() + end, s))
        return self._encode_marked(render(marked), start, end)

    def _markers(self, strings: list[str]) -> tuple[str, str]:
        used = set(_PRIVATE_USE.findall(self.template))
        for s in strings:
            used.update(_PRIVATE_USE.findall(s))
        free = (chr(c) for c in range(_FIRST_MARKER, 0x10FFFE) if chr(c) not in used)
        start, end = next(free, None), next(free, None)
        if end is None:
            raise ValueError("the prompt uses every private-use character, so its control-token text "
                             "cannot be marked as text")
        return start, end

    def _encode_marked(self, rendered: str, start: str, end: str) -> list[int]:
        # Splitting on the markers gives [text, marked token, text, ...]; a lone marker (a template that
        # cut a marked string apart) splits as None and is dropped.
        pieces = re.split(f"{start}({self.pattern.pattern}){end}|[{start}{end}]", rendered)
        ids: list[int] = []
        segment: list[tuple[str, bool]] = []  # (text, is marked user text) since the template's last token
        for i, piece in enumerate(pieces):
            if i % 2 == 1:
                if piece:
                    segment.append((piece, True))
                continue
            position = 0
            for match in self.pattern.finditer(piece):  # unmarked: the template's own control tokens
                segment.append((piece[position:match.start()], False))
                ids += self._encode_segment(segment, is_first=not ids)
                ids.append(self.token_ids[match.group()])
                segment, position = [], match.end()
            segment.append((piece[position:], False))
        return ids + self._encode_segment(segment, is_first=not ids)

    def _encode_segment(self, segment: list[tuple[str, bool]], is_first: bool) -> list[int]:
        text = "".join(piece for piece, _ in segment)
        if not text:
            return []
        ids = self._encode_piece(text, is_first, split_special_tokens=True)
        if self.ids.isdisjoint(ids):
            return ids
        # A non-special control token (<think>) matched in the joined text: encode piece by piece.
        ids = []
        for piece, is_user_text in segment:
            if piece:
                is_start = is_first and not ids
                ids += self._as_text(piece) if is_user_text else self._encode_piece(piece, is_start)
        return ids

    def _encode_piece(self, text: str, is_first: bool, split_special_tokens: bool = False) -> list[int]:
        def encode(s: str) -> list[int]:
            return self.encode(s, add_special_tokens=False, split_special_tokens=split_special_tokens)

        if is_first:
            return encode(text)
        # Mid-text: after a newline, so a SentencePiece tokenizer adds no word-start space, then drop it.
        ids = encode("\n" + text)
        if ids[:len(self._newline_ids)] == self._newline_ids:
            return ids[len(self._newline_ids):]
        return encode(text)

    # ---- text with no added tokens at all --------------------------------------------------------
    def _as_text(self, text: str) -> list[int]:
        ids = self.encode(text, add_special_tokens=False, split_special_tokens=True)
        if self.ids.isdisjoint(ids):
            return ids
        ids = self._without_added_tokens(text)  # split_special_tokens leaves non-special added tokens on
        if ids is None or not self.ids.isdisjoint(ids):
            raise ValueError("this tokenizer makes a control token of the prompt's control-token text even "
                             "when it is encoded as plain text")
        return ids

    def _without_added_tokens(self, text: str) -> list[int] | None:
        """The backend's normalizer, pre-tokenizer and model without added tokens; None with no backend."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return None
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        splits = [text]
        if backend.pre_tokenizer is not None:
            splits = [split for split, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
        return [token.id for split in splits for token in backend.model.tokenize(split)]


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _map_strings(value, fn):
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_strings(item, fn) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(item, fn) for item in value]
    return value
