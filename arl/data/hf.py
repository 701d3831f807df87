"""Prompt rows from HuggingFace `datasets` files on disk (no hub access): a `save_to_disk` folder (Dataset or
DatasetDict) or a parquet/json/jsonl/csv file, mapped to ARL rows {"id", "prompt" | "messages", "answer"}.

Columns: the prompt comes from `prompt_field` (default: the first of prompt, question, problem, messages), the
answer from `answer_field` (default: answer, else solution). A GSM8K answer ("... #### 72") becomes "72" and a
MATH solution ("... \\boxed{\\frac{1}{2}}") becomes its boxed part; the full text is kept under "solution".
Needs `pip install datasets` (the `data` extra).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from arl.utils.optional import import_optional

logger = logging.getLogger(__name__)

PROMPT_FIELDS = ("prompt", "question", "problem", "messages")
ANSWER_FIELDS = ("answer", "solution")


def _load(path: str, split: str) -> Any:
    datasets = import_optional("datasets", "dataset.name=hf needs the `datasets` package: pip install 'arl[data]'")
    if os.path.isdir(path):
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{path}: no split {split!r}; it has {sorted(ds)}")
            ds = ds[split]
        return ds
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset file not found: {path}")
    ext = path.rsplit(".", 1)[-1].lower()
    kind = {"parquet": "parquet", "json": "json", "jsonl": "json", "csv": "csv", "arrow": "arrow"}.get(ext)
    if kind is None:
        raise ValueError(f"{path}: unknown dataset file type .{ext} (parquet, json, jsonl, csv, arrow, or a "
                         "save_to_disk folder)")
    return datasets.load_dataset(kind, data_files=path, split="train")


def normalize_answer(answer: Any) -> str:
    from arl.envs.math_verify import extract_boxed

    text = str(answer).strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    boxed = extract_boxed(text)
    return boxed if boxed is not None else text


def load_hf(path: str, *, split: str = "train", prompt_field: str = "", answer_field: str = "") -> list[dict[str, Any]]:
    """Rows from a datasets file or folder on disk; rows without a prompt or an answer are skipped (counted)."""
    ds = _load(path, split)
    cols = list(ds.column_names)
    pf = prompt_field or next((c for c in PROMPT_FIELDS if c in cols), "")
    af = answer_field or next((c for c in ANSWER_FIELDS if c in cols), "")
    if pf not in cols or af not in cols:
        raise ValueError(f"{path}: need a prompt column ({prompt_field or '|'.join(PROMPT_FIELDS)}) and an answer "
                         f"column ({answer_field or '|'.join(ANSWER_FIELDS)}); it has {cols}")
    prefix = os.path.basename(path.rstrip("/")).split(".")[0]  # ids of rows without one: <prefix>-<index>
    rows, bad = [], 0
    for i, r in enumerate(ds):
        p, a = r.get(pf), r.get(af)
        if p is None or a is None or (isinstance(p, str) and not p.strip()):
            bad += 1
            continue
        row: dict[str, Any] = {"id": str(r["id"]) if r.get("id") is not None else f"{prefix}-{i}",
                               "answer": normalize_answer(a)}
        if isinstance(p, list):
            row["messages"] = [{"role": str(m["role"]), "content": str(m["content"])} for m in p]
        else:
            row["prompt"] = str(p)
        if str(a).strip() != row["answer"]:
            row["solution"] = str(a)
        rows.append(row)
    if bad:
        logger.warning("%s: skipped %d rows without a prompt or an answer", path, bad)
    if not rows:
        raise ValueError(f"{path}: no usable rows")
    return rows
