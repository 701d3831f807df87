from setuptools import find_packages, setup

setup(
    name="arl",
    version="0.1.0",
    description="ARL: asynchronous, queue-decoupled reinforcement learning for LLM agents",
    packages=find_packages(include=["arl", "arl.*", "experiments", "experiments.*"]),
    package_data={"arl.data": ["samples/*.jsonl"]},
    python_requires=">=3.10",
    # torch stays open here for GPU users; CPU machines pin it via constraints-cpu.txt (see README).
    install_requires=[
        "torch>=2.4",
        "transformers>=4.45",
        "tokenizers",
        "safetensors",
        "deepspeed>=0.15",
        "pyzmq>=25",
        "msgpack>=1.0",
        "omegaconf>=2.3",
        "numpy",
        "tqdm",
        "psutil",
        "math-verify>=0.7",
        "aiohttp>=3.9",  # HTTP client of the sglang backend (and the fake SGLang server of the tests)
    ],
    extras_require={
        # experiment trackers (loggers=[...]) and the report's curves.png; each is imported only when used
        "trackers": ["tensorboard>=2.14", "wandb>=0.19", "mlflow-skinny>=2.14", "matplotlib>=3.7"],
        "dev": ["pytest>=8", "pytest-asyncio>=0.23", "pytest-timeout", "datasets>=2.16",
                "tensorboard>=2.14", "wandb>=0.19", "mlflow-skinny>=2.14", "matplotlib>=3.7",
                "ray>=2.40",  # the two-node launcher=ray tests
                "import-linter>=2.17",  # lint-imports: the layers contract in .importlinter (.ci/run)
                "coverage>=7.10",  # scripts/files_run.py (which files a run executes, docs/architecture.md)
                "gymnasium>=1.0", "gem-llm>=0.1", "reasoning-gym>=0.1.19", "verifiers>=0.3.1",  # env adapters' tests
                "peft>=0.13",  # the learner.lora tests
                "openai>=1.40", "openai-agents>=0.2", "anthropic>=0.40"],  # the endpoint's tests and experiments (the agents extra)
        "lora": ["peft>=0.13"],  # learner.lora.rank > 0 (imported only then)
        "data": ["datasets>=2.16"],
        "sglang": ["sglang>=0.5.23", "requests"],
        "ray": ["ray>=2.40"],  # launcher=ray; imported only then
        # env adapters (env.name=gymnasium | gem | reasoning-gym, dataset.name=reasoning-gym | verifiers,
        # agent.name=verifiers); imported only then
        "envs": ["gymnasium>=1.0", "gem-llm>=0.1", "reasoning-gym>=0.1.19", "verifiers>=0.3.1"],
        # agents written against the OpenAI API (docs/openai_endpoint.md): the SDK for experiment=openai-math and
        # openai-tool-calc, the Agents SDK for openai-framework and responses-framework, Anthropic's SDK for
        # anthropic-math; imported only when such an agent runs
        "agents": ["openai>=1.40", "openai-agents>=0.2", "anthropic>=0.40"],
    },
)
