"""Tokenizer wrapper over a Hugging Face `tokenizer.json`, plus the built-in character vocabulary.

Every checkpoint directory carries a `tokenizer.json` (the `tokenizers` library format, which
`transformers.AutoTokenizer` also reads). The built-in task uses a character-level WordLevel
vocabulary written in that same format, so the demo checkpoint is an ordinary HF checkpoint.
Imports nothing of the project, so every layer may use it (the trainer, SFT, the prompt files, the
reward model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
ADDITION_CHARS = "0123456789+="


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message names the file and the problem."""


class TokenizerFileMissing(TokenizerError, FileNotFoundError):
    pass


@dataclass(frozen=True)
class Tokenizer:
    """Encode/decode with the special-token ids the trainer needs."""

    hf: HFTokenizer
    pad_id: int
    bos_id: int | None               # None: the tokenizer adds no BOS (e.g. Qwen2)
    eos_id: int
    config: dict | None = None       # tokenizer_config.json as read (chat_template, special tokens)
    # the chat templates as transformers finds them: (name, source, file) -- see read_chat_templates
    templates: tuple[tuple[str, str, str], ...] = ()

    @property
    def chat_template(self) -> str | None:
        """The template transformers' apply_chat_template uses when none is named: the only one, or
        the one named "default"; several without a default is an error (as in transformers)."""
        found = self._default_template()
        return None if found is None else found[1]

    @property
    def chat_template_file(self) -> str | None:
        found = self._default_template()
        return None if found is None else found[2]

    def _default_template(self) -> tuple[str, str, str] | None:
        if not self.templates:
            return None
        if len(self.templates) == 1:
            return self.templates[0]
        named = {t[0]: t for t in self.templates}
        if "default" not in named:
            raise TokenizerError(f"tokenizer: {self.templates[0][2]}: several chat templates "
                                 f"({', '.join(sorted(named))}) and none named 'default': transformers "
                                 f"refuses to choose, and so do we")
        return named["default"]

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.hf.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return [self.bos_id] + ids if add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        # Stops at EOS; drops specials. A BPE tokenizer decodes with its decoder (byte-level
        # merges); WordLevel has none, so join the token strings.
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        if self.hf.decoder is not None:
            return self.hf.decode(ids, skip_special_tokens=True)
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            tok = self.hf.id_to_token(int(i))
            if tok is not None and tok not in SPECIALS:
                out.append(tok)
        return "".join(out)

    def save(self, directory: str | Path) -> dict[str, bytes]:
        """Write tokenizer.json + tokenizer_config.json; returns {filename: bytes} written."""
        files = self.files()
        for name, data in files.items():
            Path(directory, name).parent.mkdir(parents=True, exist_ok=True)
            Path(directory, name).write_bytes(data)
        return files

    def files(self) -> dict[str, bytes]:
        cfg = self.config or {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
                              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
        out = {"tokenizer.json": self.hf.to_str().encode(), "tokenizer_config.json": json.dumps(cfg, indent=2).encode()}
        for name, source, file in self.templates:  # the template files travel as they came
            if not file.endswith("tokenizer_config.json"):
                rel = CHAT_TEMPLATE_FILE if name == "default" and Path(file).name == CHAT_TEMPLATE_FILE \
                    else f"{CHAT_TEMPLATE_DIR}/{name}.jinja"
                out[rel] = source.encode()
        return out

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer":
        path = Path(directory, "tokenizer.json")
        if not path.is_file():
            raise TokenizerFileMissing(f"tokenizer: {path} not found (a checkpoint dir needs tokenizer.json)")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception for any bad file
            raise TokenizerError(f"tokenizer: {path} cannot be parsed as a tokenizers JSON file: {e}") from None
        config = _read_tokenizer_config(Path(directory, "tokenizer_config.json"))
        if config is None or not any(k in config for k in ("bos_token", "eos_token", "pad_token")):
            ids = {name: hf.token_to_id(name) for name in (PAD, BOS, EOS)}
            missing = [n for n, i in ids.items() if i is None]
            if missing:
                raise TokenizerError(f"tokenizer: {path} lacks the special tokens {missing} "
                                     f"(needs {PAD}, {BOS}, {EOS}, or a tokenizer_config.json naming them)")
            return cls(hf, pad_id=ids[PAD], bos_id=ids[BOS], eos_id=ids[EOS], config=config,
                       templates=read_chat_templates(Path(directory), config))
        # A Hugging Face checkpoint: the special tokens are the ones tokenizer_config.json names.
        names = {k: _token_content(config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        ids = {k: None if v is None else hf.token_to_id(v) for k, v in names.items()}
        unknown = [f"{k}={names[k]!r}" for k in names if names[k] is not None and ids[k] is None]
        if unknown or ids["eos_token"] is None:
            raise TokenizerError(f"tokenizer: {path.parent / 'tokenizer_config.json'} names special tokens "
                                 f"missing from tokenizer.json ({', '.join(unknown) or 'eos_token unset'}); "
                                 f"eos_token is required")
        pad = ids["pad_token"] if ids["pad_token"] is not None else ids["eos_token"]  # Llama has no pad
        return cls(hf, pad_id=pad, bos_id=ids["bos_token"], eos_id=ids["eos_token"], config=config,
                   templates=read_chat_templates(Path(directory), config))


CHAT_TEMPLATE_FILE = "chat_template.jinja"          # transformers >= 4.5x saves the template here
CHAT_TEMPLATE_DIR = "additional_chat_templates"     # ... and named extra templates here, NAME.jinja


def read_chat_templates(directory: Path, config: dict | None) -> tuple[tuple[str, str, str], ...]:
    """(name, source, file) of every chat template, found as transformers finds them: template files
    (chat_template.jinja as "default", additional_chat_templates/NAME.jinja) take priority over
    tokenizer_config.json's `chat_template`, which is a string or a list of {"name", "template"}."""
    files: list[tuple[str, Path]] = []
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        files.append(("default", directory / CHAT_TEMPLATE_FILE))
    if (directory / CHAT_TEMPLATE_DIR).is_dir():
        files += [(f.name.removesuffix(".jinja"), f) for f in sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja"))]
    if files:
        out = []
        for name, f in files:
            try:
                out.append((name, f.read_text(encoding="utf-8"), str(f)))
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"tokenizer: chat template {f} cannot be read as UTF-8 text: {e}") from None
        return tuple(out)
    where = str(directory / "tokenizer_config.json")
    value = (config or {}).get("chat_template")
    if value is None:
        return ()
    if isinstance(value, str):
        return (("default", value, where),)
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value) and value:
        return tuple((t["name"], t["template"], where) for t in value)
    raise TokenizerError(f"tokenizer: {where}: chat_template must be a string or a list of "
                         f'{{"name": ..., "template": ...}} objects, not {str(value)[:80]!r}')


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_tokenizer_config(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"tokenizer: {path} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"tokenizer: {path} must hold a JSON object, not {type(config).__name__}")
    return config


def char_tokenizer(chars: str = ADDITION_CHARS) -> Tokenizer:
    """A WordLevel tokenizer with one token per character and the four specials first."""
    vocab = {tok: i for i, tok in enumerate(list(SPECIALS) + list(chars))}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token=UNK))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf.add_special_tokens(list(SPECIALS))
    return Tokenizer(hf, pad_id=vocab[PAD], bos_id=vocab[BOS], eos_id=vocab[EOS])
