"""Import-only stand-in for SGLang's CUDA kernel package, for the real-SGLang-on-CPU tests only.

`scripts/test_sglang_cpu.sh` puts this folder on PYTHONPATH; the default test suite never does. SGLang 0.5.x
imports these names at module level on the CPU path; none of them is called when generating with the
torch_native attention backend, so each one raises if it ever is.
"""

__version__ = "0.0.0-arl-stub"

_NAMES = [
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]


def _make(name: str):
    def _missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is a test stub (no CPU kernel); it must not be called")

    _missing.__name__ = name
    return _missing


for _n in _NAMES:
    globals()[_n] = _make(_n)
