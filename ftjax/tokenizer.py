"""Tokenizer: a Hugging Face ``tokenizer.json`` plus the model's Jinja chat template.

``Tokenizer.from_dir`` reads what a checkpoint (or an FTW store, which copies these files) ships:
``tokenizer.json``, ``tokenizer_config.json`` (chat template, eos/pad tokens), ``chat_template.jinja``,
``generation_config.json`` and ``config.json`` (eos ids). The chat template is rendered the way
``transformers`` renders it: sandboxed Jinja, ``trim_blocks``/``lstrip_blocks``, a ``tojson`` filter
that keeps non-ASCII text, ``raise_exception`` and ``strftime_now``.
"""
from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Any, Iterable, Sequence

import jinja2
import jinja2.sandbox
import tokenizers

log = logging.getLogger(__name__)

# Ids of a stream whose text is not final yet: decode this many tokens before the read offset
# again so a byte-level merge that straddles the offset is decoded in context.
_DETOK_CONTEXT = 6


class TokenizerError(ValueError):
    """Missing or malformed tokenizer files, or a chat template that cannot be rendered."""


class ChatTemplateError(TokenizerError):
    """The chat template raised (``raise_exception``) or failed to render."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from e


def _token_content(tok: Any) -> str | None:
    """tokenizer_config tokens are either strings or AddedToken dicts ({"content": ...})."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _pick_template(raw: Any, tools: Any, name: str | None) -> str | None:
    """A chat_template field is a string or a list of {"name", "template"} (HF named templates)."""
    if raw is None or isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise TokenizerError(f"chat_template must be a string or a list of named templates, got {type(raw).__name__}")
    named = {t["name"]: t["template"] for t in raw if isinstance(t, dict) and "name" in t and "template" in t}
    if name is not None:
        if name not in named:
            raise TokenizerError(f"no chat template named {name!r}; available: {sorted(named)}")
        return named[name]
    if tools and "tool_use" in named:
        return named["tool_use"]
    if "default" in named:
        return named["default"]
    raise TokenizerError(f"no 'default' chat template among {sorted(named)}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' tojson: unlike Jinja's built-in it does not HTML-escape and keeps non-ASCII.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _make_env() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class Tokenizer:
    """Encode/decode text and render chat prompts for one model."""

    def __init__(self, tok: tokenizers.Tokenizer, *, chat_template: Any = None,
                 eos_token_ids: Sequence[int] = (), special_tokens: dict[str, str] | None = None,
                 source: str = "<memory>"):
        self._tok = tok
        self._chat_template = chat_template
        self._special_tokens = dict(special_tokens or {})  # role -> text: eos_token, pad_token, ...
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.source = source
        self._env = _make_env()
        self._compiled: dict[str, jinja2.Template] = {}

    # ---- construction ----
    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load from a checkpoint directory, or an FTW store (its copies live in ``hf/``);
        raise TokenizerError naming a missing file."""
        d = Path(path)
        if not (d / "tokenizer.json").is_file() and (d / "hf" / "tokenizer.json").is_file():
            d = d / "hf"
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"no tokenizer.json in {d}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"{tj}: cannot be read by `tokenizers` ({e})") from e
        tcfg = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
        template: Any = tcfg.get("chat_template")
        jinja_file = d / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        special = {k: _token_content(tcfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        special = {k: v for k, v in special.items() if v}

        eos: list[int] = []
        gen = d / "generation_config.json"
        if gen.is_file():
            eos += _as_id_list(_read_json(gen).get("eos_token_id"))
        if "eos_token" in special:
            eid = tok.token_to_id(special["eos_token"])
            if eid is not None:
                eos.append(eid)
        cfg = d / "config.json"
        if cfg.is_file():
            raw = _read_json(cfg)
            eos += _as_id_list(raw.get("eos_token_id", (raw.get("text_config") or {}).get("eos_token_id")))
        if not eos:
            log.warning("%s: no eos token found in generation_config/tokenizer_config/config", d)
        return cls(tok, chat_template=template, eos_token_ids=eos, special_tokens=special, source=str(d))

    # ---- vocabulary ----
    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (the model's embedding may be padded larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        """Id of a single token by its text (e.g. ``"<|im_end|>"``); KeyError if it is not one token."""
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise KeyError(f"{token!r} is not a single token of the tokenizer at {self.source}")
        return tid

    def added_token_ids(self) -> dict[str, int]:
        """All added tokens (special or not, e.g. ``<think>``), text -> id."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}

    @property
    def pad_token_id(self) -> int | None:
        pad = self._special_tokens.get("pad_token")
        return None if pad is None else self._tok.token_to_id(pad)

    # ---- text <-> ids ----
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of ``text``; special tokens written in the text (``<|im_start|>``) map to their ids."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = False) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # ---- chat ----
    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            enable_thinking: bool | None = None, tools: Sequence[dict] | None = None,
                            template_name: str | None = None, **kwargs: Any) -> str:
        """Render ``messages`` ([{"role", "content", ...}]) with the model's chat template.

        ``enable_thinking=None`` leaves the variable undefined (the template's default).
        """
        source = _pick_template(self._chat_template, tools, template_name)
        if source is None:
            raise TokenizerError(f"the tokenizer at {self.source} has no chat template "
                                 "(no chat_template in tokenizer_config.json, no chat_template.jinja)")
        if source not in self._compiled:
            try:
                self._compiled[source] = self._env.from_string(source)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"chat template of {self.source} does not parse: {e}") from e
        ctx: dict[str, Any] = dict(self._special_tokens)
        ctx.update(messages=list(messages), tools=list(tools) if tools else None,
                   add_generation_prompt=add_generation_prompt, **kwargs)
        if enable_thinking is not None:
            ctx["enable_thinking"] = enable_thinking
        try:
            return self._compiled[source].render(**ctx)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template of {self.source} failed: {e}") from e


class IncrementalDetokenizer:
    """Turns a stream of ids into text deltas.

    Byte-level BPE can split one UTF-8 character over several tokens; a delta is only released
    once the decoded tail no longer ends in U+FFFD (an incomplete character). ``flush`` releases
    whatever is left at the end of the stream.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tk = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # decode window start (context for the merge at the read offset)
        self._read = 0  # ids before this are already emitted as text
        self.text = ""

    def add(self, ids: int | Iterable[int]) -> str:
        """Append token id(s); return the newly final text (possibly "")."""
        self.ids.extend([ids] if isinstance(ids, int) else [int(i) for i in ids])
        prefix_text = self._tk.decode(self.ids[self._prefix:self._read], self._skip)
        full_text = self._tk.decode(self.ids[self._prefix:], self._skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text):]
        self._read = len(self.ids)
        self._prefix = max(0, self._read - _DETOK_CONTEXT)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Release the rest (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._tk.decode(self.ids[self._prefix:self._read], self._skip)
        full_text = self._tk.decode(self.ids[self._prefix:], self._skip)
        delta = full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""
        self._read = len(self.ids)
        self._prefix = max(0, self._read - _DETOK_CONTEXT)
        self.text += delta
        return delta
