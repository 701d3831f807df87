"""Moving weights from the learner to inference workers without a shared disk (``weights.transport = broadcast``).

`broadcast.py` is the torch.distributed side (a sender on the learner, a receiver in a torch engine); `sglang.py`
drives an SGLang server's own distributed weight-update endpoints from the worker that owns the server.
"""
