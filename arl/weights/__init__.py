"""How new weights travel from the learner to the inference servers: transports as strategies, picked by name.

`strategy.py`: the protocol of a transport's three sides (learner, inference, controller) and the registry;
`disk.py`: the ``disk`` transport (``weights/v{N}.safetensors``); `broadcast.py`: the ``broadcast`` transport (no
file), built on `channel.py` (the learner's publisher, a server's loader) and the wire: `plan.py` (layout and
buckets), `group.py` (groups on the sender's store, signed keys), `sender.py` (each wire protocol in a class of its
own), `receiver.py` (a torch engine's side) and `sglang.py` (drives an SGLang server's own endpoints).
"""
