"""The API dialects the endpoint speaks besides OpenAI's chat and completions (`arl.rollout.endpoint`): each module
translates its requests into chat form (`common.ChatCall`) and writes answers (`common.Answer`) back in its own
shape, so one session machinery serves them all."""
