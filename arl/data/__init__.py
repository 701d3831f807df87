"""Datasets: the built-in a+b task and jsonl loading."""

from arl.data.arith import make_arith_splits
from arl.data.jsonl import load_jsonl

__all__ = ["make_arith_splits", "load_jsonl"]
