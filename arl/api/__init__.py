"""Public contracts. Nothing here imports zmq, sglang or deepspeed."""

from arl.api.agent import Agent, EnvironmentService
from arl.api.engine import InferenceEngine, TrainBatch, TrainEngine
from arl.api.registry import (AGENTS, ENVS, EXPERIMENTS, RegistryError, make_agent, make_env, register_agent,
                              register_env, register_experiment)
from arl.api.types import (GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput, Trajectory,
                           TrajectoryBuilder, check_reward, scalar_reward)

__all__ = ["Agent", "EnvironmentService", "InferenceEngine", "TrainBatch", "TrainEngine", "AGENTS", "ENVS",
           "EXPERIMENTS", "RegistryError", "make_agent", "make_env", "register_agent", "register_env",
           "register_experiment", "GenerateRequest", "GenerateResponse", "GenerationConfig", "SampleOutput",
           "Trajectory", "TrajectoryBuilder", "check_reward", "scalar_reward"]
