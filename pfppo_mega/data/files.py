"""Prompt files in verl's schema (JSONL or Parquet, one or several) -> `Sample`s, and the
`FilePrompts` source that walks them in seeded epochs.

A row: `prompt` (a list of {role, content} chat messages, or a string), `data_source`,
`reward_model: {ground_truth}`, `extra_info` (the column names are data.*_key; a dotted key
reads into nested mappings). Every problem is found at start and named with the file and the
row: a missing or unreadable file, a row without the prompt, a prompt of the wrong shape, a key
twice in one JSON object (json itself would keep the last silently).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pfppo_mega.data.chat import ChatTemplate, ChatTemplateError, check_messages
from pfppo_mega.types import Sample


class DataError(ValueError):
    """A prompt file or row that cannot be used; the message names the file, the row and the key."""


FORMATS = (".jsonl", ".json", ".parquet")

_MISSING = object()


@dataclass(frozen=True)
class Keys:
    prompt: str = "prompt"
    data_source: str = "data_source"
    ground_truth: str = "reward_model.ground_truth"
    extra_info: str = "extra_info"


def read_rows(path: str | Path, key: str) -> list[dict[str, Any]]:
    """The rows of one file as dicts. JSONL: one JSON object per non-empty line (.json: the same,
    or one JSON list of objects). Parquet: through pyarrow."""
    p = Path(path)
    where = f"{key} {str(path)!r}"
    if p.suffix not in FORMATS:
        raise DataError(f"{where}: unknown format {p.suffix!r} (allowed: {', '.join(FORMATS)})")
    if not p.is_file():
        raise DataError(f"{where}: no such file")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq  # pinned in requirements.lock
        try:
            rows = pq.read_table(p).to_pylist()
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError / ... for a damaged file
            raise DataError(f"{where}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    else:
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{where}: cannot be read as UTF-8 text ({type(e).__name__}: {e})") from None
        rows = _json_rows(text, where, whole=p.suffix == ".json")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise DataError(f"{where} row {i}: a row must be a JSON object / Parquet record, got "
                            f"{type(r).__name__}")
    return rows


def _json_rows(text: str, where: str, *, whole: bool) -> list[Any]:
    stripped = text.lstrip()
    pairs = _KeepPairs()
    if whole and stripped.startswith("["):
        try:
            rows = json.loads(stripped, object_pairs_hook=pairs)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e})") from None
        except RecursionError:
            raise DataError(f"{where}: nested deeper than Python's JSON reader allows") from None
        if pairs.twice:
            i, key = next((i, k) for i, r in enumerate(rows) if (k := pairs.find(r)) is not None)
            raise DataError(f"{where} row {i}: {_twice(key)}")
        return rows
    rows = []
    for n, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line, object_pairs_hook=pairs))
        except json.JSONDecodeError as e:
            raise DataError(f"{where} line {n + 1}: not valid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise DataError(f"{where} line {n + 1}: nested deeper than Python's JSON reader allows") from None
        if pairs.twice:
            raise DataError(f"{where} line {n + 1} (row {len(rows) - 1}): {_twice(pairs.find(rows[-1]))}")
    return rows


def _twice(key: str | None) -> str:
    return (f"key {key!r} appears twice in one object (JSON would silently keep the last one): a row's keys "
            f"must be unique; remove or merge the duplicate")


class _KeepPairs:
    """json's object_pairs_hook: builds each object as json does, and remembers (by identity) the
    objects that held a key twice, so the reader can name the row and the key's path."""

    def __init__(self) -> None:
        self.twice: dict[int, tuple[str, dict]] = {}   # id(object) -> (the repeated key, the object: kept
                                                        # alive, so its id is not reused)

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) < len(pairs):
            seen: set[str] = set()
            self.twice[id(obj)] = (next(k for k, _ in pairs if k in seen or seen.add(k)), obj)
        return obj

    def find(self, row: Any) -> str | None:
        """The dotted path of the first repeated key inside `row` (walked without recursion), or None."""
        stack = [(row, "")]
        while stack:
            node, path = stack.pop()
            if isinstance(node, dict):
                if id(node) in self.twice:
                    key = self.twice[id(node)][0]
                    return f"{path}.{key}" if path else key
                stack += [(v, f"{path}.{k}" if path else k) for k, v in node.items()]
            elif isinstance(node, list):
                stack += [(v, f"{path}[{i}]") for i, v in enumerate(node)]
        return None


def get_path(row: dict[str, Any], dotted: str) -> Any:
    """row["a"]["b"] for "a.b" (a flat key "a.b" wins); _MISSING when absent."""
    if dotted in row:
        return row[dotted]
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


@dataclass
class Encoded:
    samples: list[Sample]
    overlong: int                  # rows dropped for > max_prompt_length tokens
    longest: int                   # longest prompt kept, in tokens
    truncated: int = 0             # rows cut to max_prompt_length tokens (overlong left / right / middle)


def truncate(ids: list[int], max_length: int, *, side: str) -> list[int]:
    """verl's data.truncation (verl/utils/torch_functional.py postprocess_data), on one prompt's
    token ids: left keeps the last max_length, right the first max_length, middle the first
    max_length // 2 and the last max_length - max_length // 2."""
    if len(ids) <= max_length:
        return list(ids)
    if side == "left":
        return list(ids[-max_length:])
    if side == "right":
        return list(ids[:max_length])
    if side == "middle":
        head = max_length // 2
        return list(ids[:head]) + list(ids[len(ids) - (max_length - head):])
    raise ValueError(f"side={side!r}: must be one of 'left', 'right', 'middle'")


def encode_rows(rows: list[dict[str, Any]], *, key: str, file: str, keys: Keys, tokenizer,
                template: ChatTemplate | None, max_prompt_length: int, overlong: str) -> Encoded:
    """Rows -> Samples: chat template applied (a string prompt is one user message), tokenized,
    over-long prompts dropped and counted ("filter"), refused ("error") or cut ("left", "right",
    "middle": truncate(); the sample's prompt_text is then the decoded cut ids)."""
    out, dropped, truncated, longest = [], 0, 0, 0
    where = f"{key} {file!r}"
    bos = tokenizer.token(tokenizer.bos_id)
    for i, row in enumerate(rows):
        at = f"{where} row {i}"
        prompt = get_path(row, keys.prompt)
        if prompt is _MISSING:
            raise DataError(f"{at}: no {keys.prompt!r} key (data.prompt_key; the row has keys {sorted(row)[:20]})")
        messages = check_messages(prompt)
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}] if template is not None else None
            text = prompt
        elif messages is None:
            raise DataError(f"{at}: {keys.prompt!r} must be a string or a non-empty list of "
                            f"{{role, content}} messages with string values, got {str(prompt)[:120]}")
        elif template is None:
            raise DataError(f"{at}: {keys.prompt!r} is a list of chat messages but the checkpoint's "
                            f"directory has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json; "
                            f"or data.apply_chat_template is false)")
        if messages is not None:
            try:
                text = template.render(messages, add_generation_prompt=True)
            except ChatTemplateError as e:
                raise DataError(f"{at}: {e}") from None
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\\ud800" in JSON): no tokenizer can read it
            raise DataError(f"{at}: the prompt is not valid Unicode ({e.reason} at character {e.start}: "
                            f"{text[max(0, e.start - 20):e.start]!r} ...)") from None
        ids = tokenizer.encode(text, add_bos=not (bos and text.startswith(bos)))
        if len(ids) > max_prompt_length:
            if overlong == "error":
                raise DataError(f"{at}: the prompt has {len(ids)} tokens > data.max_prompt_length "
                                f"({max_prompt_length}) (data.overlong_prompts = error; 'filter' drops such rows, "
                                f"'left' / 'right' / 'middle' cut them as verl's data.truncation)")
            if overlong == "filter":
                dropped += 1
                continue
            ids = truncate(ids, max_prompt_length, side=overlong)
            text = tokenizer.decode(ids)
            truncated += 1
        longest = max(longest, len(ids))
        source = get_path(row, keys.data_source)
        gt = get_path(row, keys.ground_truth)
        extra = get_path(row, keys.extra_info)
        out.append(Sample(prompt_ids=tuple(ids), data_source="" if source is _MISSING else str(source),
                          ground_truth=None if gt is _MISSING else gt,
                          extra_info={} if extra is _MISSING or extra is None else extra,
                          prompt_text=text, row=f"{file}:{i}",
                          messages=tuple(dict(m) for m in messages) if messages is not None else ()))
    return Encoded(out, dropped, longest, truncated)


def load_samples(files: list[str], *, key: str, keys: Keys, tokenizer, template: ChatTemplate | None,
                 max_prompt_length: int, overlong: str, log: Callable[[str], None]) -> list[Sample]:
    """Every file's rows, encoded; the overlong count reported per file; an empty result refused."""
    samples: list[Sample] = []
    dropped = 0
    for f in files:
        enc = encode_rows(read_rows(f, key), key=key, file=f, keys=keys, tokenizer=tokenizer,
                          template=template, max_prompt_length=max_prompt_length, overlong=overlong)
        if enc.truncated:
            log(f"[pfppo] {key} {f!r}: cut {enc.truncated} prompt(s) longer than data.max_prompt_length "
                f"({max_prompt_length} tokens) at the {overlong} (data.overlong_prompts = {overlong})")
        if enc.overlong:
            log(f"[pfppo] {key} {f!r}: dropped {enc.overlong} prompt(s) longer than data.max_prompt_length "
                f"({max_prompt_length} tokens); kept {len(enc.samples)}")
        samples += enc.samples
        dropped += enc.overlong
    if not samples and dropped:
        raise DataError(f"{key} {files}: no usable prompt: all {dropped} row(s) are longer than "
                        f"data.max_prompt_length = {max_prompt_length} tokens and data.overlong_prompts = filter "
                        f"dropped them; raise data.max_prompt_length, or cut them with data.overlong_prompts = "
                        f"left / right / middle")
    if not samples:
        raise DataError(f"{key} {files}: no usable prompt: the file(s) hold no rows")
    return samples


class FilePrompts:
    """The training rows in seeded epochs. Position = (epoch, offset into the epoch's order),
    the same on every data-parallel rank; each rank takes its own slice of each global batch."""

    observes = False  # the order does not depend on the scores

    def __init__(self, samples: list[Sample], *, seed: int, shuffle: bool, dp_rank: int = 0, dp_size: int = 1):
        self.samples, self.seed, self.shuffle = samples, seed, shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch, self.offset = 0, 0
        self._order = self._epoch_order(0)
        self._digest: str | None = None

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.samples)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if self.offset == len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            k = min(n - len(out), len(self._order) - self.offset)
            out += self._order[self.offset: self.offset + k]
            self.offset += k
        return out

    @property
    def rows_per_pass(self) -> int:
        """Prompts this rank draws in one pass over the rows (each rank takes 1/dp_size of every batch)."""
        return -(-len(self.samples) // self.dp_size)

    def next_batch(self, n: int) -> list[Sample]:
        """n prompts for this rank (the global batch is n * dp_size rows, epochs wrap around)."""
        idx = self._take(n * self.dp_size)
        return [self.samples[i] for i in idx[self.dp_rank * n: (self.dp_rank + 1) * n]]

    def observe(self, rows: list[Sample], scores, rewards, step: int) -> None:
        pass

    def digest(self) -> str:
        """sha256 over what training reads from the rows (prompt token ids, data source, ground truth):
        the same files edited in place, re-tokenised or re-templated give another digest."""
        if self._digest is None:
            h = hashlib.sha256()
            for smp in self.samples:
                h.update(len(smp.prompt_ids).to_bytes(4, "little"))
                h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in smp.prompt_ids))
                h.update(json.dumps([smp.data_source, smp.ground_truth], sort_keys=True, default=repr).encode())
            self._digest = h.hexdigest()
        return self._digest

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "rows": len(self.samples), "digest": self.digest()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("rows") != len(self.samples):
            raise DataError(f"data position {state!r} was saved for {state.get('rows') if isinstance(state, dict) else '?'} "
                            f"training rows, but data.train_files now give {len(self.samples)}: resume with the same files")
        if state.get("digest") != self.digest():
            raise DataError(f"data.train_files: the training rows changed since this checkpoint was written (same "
                            f"{len(self.samples)} rows, content digest {str(state.get('digest'))[:12]} -> "
                            f"{self.digest()[:12]}: edited files, another tokenizer or chat template); the saved "
                            f"position would index other prompts. Resume with the files it was written with, or "
                            f"start a new logging.output_dir (or checkpoint.resume=false)")
        epoch, offset = state["epoch"], state["offset"]
        if not (type(epoch) is int and type(offset) is int and epoch >= 0 and 0 <= offset <= len(self.samples)):
            raise DataError(f"data position epoch={epoch!r} offset={offset!r}: must be ints, offset in [0, "
                            f"{len(self.samples)}]")
        self.epoch, self.offset = epoch, offset
        self._order = self._epoch_order(epoch)
