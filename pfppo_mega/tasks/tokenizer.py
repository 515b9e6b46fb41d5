"""Tokenizer wrapper over a Hugging Face `tokenizer.json`, plus the built-in character vocabulary.

Every checkpoint directory carries a `tokenizer.json` (the `tokenizers` library format, which
`transformers.AutoTokenizer` also reads). The built-in task uses a character-level WordLevel
vocabulary written in that same format, so the demo checkpoint is an ordinary HF checkpoint.
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
    bos_id: int
    eos_id: int

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return [self.bos_id] + ids if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        # Stops at EOS; drops specials. WordLevel has no decoder, so join the token strings.
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
            Path(directory, name).write_bytes(data)
        return files

    def files(self) -> dict[str, bytes]:
        cfg = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
               "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
        return {"tokenizer.json": self.hf.to_str().encode(),
                "tokenizer_config.json": json.dumps(cfg, indent=2).encode()}

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer":
        path = Path(directory, "tokenizer.json")
        if not path.is_file():
            raise TokenizerFileMissing(f"tokenizer: {path} not found (a checkpoint dir needs tokenizer.json)")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception for any bad file
            raise TokenizerError(f"tokenizer: {path} cannot be parsed as a tokenizers JSON file: {e}") from None
        ids = {name: hf.token_to_id(name) for name in (PAD, BOS, EOS)}
        missing = [n for n, i in ids.items() if i is None]
        if missing:
            raise TokenizerError(f"tokenizer: {path} lacks the special tokens {missing} "
                             f"(needs {PAD}, {BOS}, {EOS})")
        return cls(hf, pad_id=ids[PAD], bos_id=ids[BOS], eos_id=ids[EOS])


def char_tokenizer(chars: str = ADDITION_CHARS) -> Tokenizer:
    """A WordLevel tokenizer with one token per character and the four specials first."""
    vocab = {tok: i for i, tok in enumerate(list(SPECIALS) + list(chars))}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token=UNK))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf.add_special_tokens(list(SPECIALS))
    return Tokenizer(hf, pad_id=vocab[PAD], bos_id=vocab[BOS], eos_id=vocab[EOS])
