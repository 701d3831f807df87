"""Recipes: supervised warm-ups that turn the random tiny model into a policy RL can start from.

`model.warmup` names one ("module:function", called with cache_dir, seed, target_acc, max_steps, num_threads);
empty means `warmup_arith.get_warm_model` (a+b). `sft` holds what they share: the masked SFT loop, batched greedy
decoding and the locked, hashed model cache.
"""
