"""Experiment configuration: dataclasses merged with `key=value` command-line overrides through omegaconf.

Every field carries its help text in `metadata["help"]`, which `--help` prints. Errors name the offending key
(with close matches for typos) instead of showing a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib
import inspect
import os
import re
from typing import TYPE_CHECKING, Any, Optional, Sequence

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from arl.api.registry import AGENTS, INFERENCE_BACKENDS, LEARNER_BACKENDS, TRACKERS
from arl.utils.errors import ConfigError
from arl.api.staleness import StalenessPolicy

ENV_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # ray.env_vars keys
DATASETS = ("arith", "jsonl", "hf", "word-arith", "reasoning-gym", "verifiers", "env-seeds")  # dataset.name (arl/data/splits.py)

if TYPE_CHECKING:
    from arl.weights.strategy import RunFacts, WeightsSettings


def _require(checks: Sequence[tuple[bool, str]]) -> None:
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)


def field(default: Any = MISSING, help: str = "", factory: Any = None) -> Any:
    md = {"help": help}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=md)
    return dataclasses.field(default=default, metadata=md)


@dataclasses.dataclass
class ModelConfig:
    path: str = field("", "HF model directory. Empty: build the tiny char-level Llama and warm it up (cached).")
    cache_dir: str = field("~/.cache/arl", "Where the built-in tiny model's warm-up checkpoint is cached.")
    warmup_target_acc: float = field(0.30, "Warm-up stops at this greedy test accuracy (tiny model only).")
    warmup_max_steps: int = field(600, "Upper bound on supervised warm-up steps (tiny model only).")
    warmup: str = field("", "Tiny-model warm-up recipe: '' (a+b) or 'module:function' returning a model dir "
                            "(called with cache_dir, seed, target_acc, max_steps, num_threads).")


@dataclasses.dataclass
class DatasetConfig:
    name: str = field("arith", "'arith' (built-in a+b task), 'jsonl' (rows with id, prompt|messages, answer), "
                               "'hf' (HuggingFace datasets on disk: save_to_disk dir or parquet/jsonl file), "
                               "'word-arith' (built-in arithmetic word problems for tool agents), 'reasoning-gym' "
                               "(its tasks `tasks`, needs arl[envs]), 'verifiers' (a verifiers environment's data set, "
                               "`verifiers_env`, needs arl[envs]) or 'env-seeds' (rows that only carry a seed, "
                               "for envs whose reset makes the task: gymnasium, gem).")
    prompt_field: str = field("", "hf: column holding the prompt ('' = prompt|question|problem|messages).")
    answer_field: str = field("", "hf: column holding the answer ('' = answer|solution; GSM8K '#### x' kept whole).")
    train_path: str = field("", "jsonl training file (name=jsonl).")
    test_path: str = field("", "jsonl held-out file (name=jsonl).")
    max_operand: int = field(49, "arith: operands are drawn from 0..max_operand.")
    test_size: int = field(200, "arith: number of held-out pairs; reasoning-gym: held-out rows per task; "
                                "env-seeds: held-out seeds.")
    tasks: list[str] = field(help="reasoning-gym: task names (reasoning_gym.create_dataset), e.g. "
                                  "[basic_arithmetic, chain_sum].", factory=list)
    train_size: int = field(1000, "reasoning-gym: training rows per task; env-seeds: training seeds; verifiers: "
                                  "at most this many of the environment's rows (0 = all).")
    verifiers_env: str = field("", "verifiers: the environment, an env id for verifiers.load_environment or "
                                   "'module:function' returning one (run it with agent.name=verifiers).")
    verifiers_args: dict[str, Any] = field(help="verifiers: keyword arguments for the environment's loader.",
                                           factory=dict)


@dataclasses.dataclass
class GenerationArgs:
    max_new_tokens: int = field(8, "New tokens per turn.")
    min_new_tokens: int = field(0, "Stop tokens are masked until this many tokens were generated.")
    temperature: float = field(1.0, "Sampling temperature (the learner recomputes logprobs at the same one).")
    top_p: float = field(1.0, "Nucleus sampling threshold.")
    top_k: int = field(0, "Top-k sampling; 0 disables.")


@dataclasses.dataclass
class AgentConfig:
    name: str = field("math-multi-turn", "Registered agent name (register_agent).")
    group_size: int = field(8, "Trajectories per prompt (the group of group-normalised advantages).")
    args: dict[str, Any] = field(help="Extra keyword arguments for the agent's constructor.", factory=dict)


@dataclasses.dataclass
class EnvConfig:
    name: str = field("math", "Registered environment name (register_env).")
    args: dict[str, Any] = field(help="Extra keyword arguments for the environment's constructor.", factory=dict)
    servers: int = field(0, "Env-server processes hosting the envs (one session per env instance, rollout workers "
                            "reach them over ZMQ); 0: envs live inside the rollout workers.")
    call_timeout: float = field(0.0, "env servers: seconds one env call may take at the server before it is "
                                     "abandoned and its session closed; 0: 0.9 x rollout.env_timeout; must be < "
                                     "rollout.env_timeout.")
    session_lease_s: float = field(600.0, "env servers: a session idle this long is closed; must exceed two "
                                          "request deadlines (a turn's generation).")
    max_restarts: int = field(3, "env servers: most restarts of env servers in one run; one more failure stops it.")
    heartbeat_timeout: float = field(60.0, "env servers: one silent this long is restarted (its sessions' groups "
                                           "are dropped).")
    drain_timeout_s: float = field(60.0, "env servers: one leaving the run (`arl.ctl scale env=-n`) opens no new "
                                         "session and is stopped once its open ones ended, or after this long (the "
                                         "groups of sessions still open then are dropped, counted).")


class ModelDType(enum.StrEnum):
    """The dtype the embedded engine holds the model in."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class LearnerDevice(enum.StrEnum):
    """Where the learner is expected to train (DeepSpeed's accelerator places it; see LearnerConfig.device)."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class PauseMode(enum.StrEnum):
    """How an SGLang server pauses for a weight update."""

    retract = "retract"
    in_place = "in_place"
    abort = "abort"


@dataclasses.dataclass
class SimEngineConfig:
    """The simulated inference engine (benchmarks): decode-step costs fitted to a 7B model on one H100."""

    step_base_s: float = field(7.5e-3, "Seconds of a decode step at batch 0 (H100, 7B fit).")
    step_per_token_s: float = field(8.0e-5, "Extra decode-step seconds per running sample.")
    prefill_per_token_s: float = field(1.8e-5, "Prefill seconds per prompt token not cached.")
    update_pause_s: float = field(1.0, "Seconds a weight update stalls decoding.")
    time_scale: float = field(1.0, "Multiplies every simulated duration (<1 runs faster than real).")
    len_median: float = field(600.0, "Median output length (log-normal, long-tailed).")
    len_sigma: float = field(1.0, "Log-normal shape of output lengths (bigger: longer tail).")
    vocab_size: int = field(32000, "Vocabulary size of the random output tokens.")
    cache_tokens: int = field(120_000, "Prefix-cache capacity in tokens (a 7B MHA model's KV at ~512 KiB/token in "
                                       "the ~60 GB an 80 GB GPU leaves); 0: no cache.")
    cache_block_tokens: int = field(16, "Tokens per cached block (the cache's granularity).")
    flush_cache_on_update: bool = field(True, "A weight update empties the cache (as SGLang's and the torch "
                                              "engine's do: no KV of old weights is reused).")

    def __post_init__(self) -> None:
        _require([
            (self.cache_tokens >= 0 and self.cache_block_tokens >= 1,
             "inference.sim.cache_tokens must be >= 0 and cache_block_tokens >= 1"),
            (min(self.step_base_s, self.step_per_token_s, self.prefill_per_token_s, self.update_pause_s) >= 0,
             "inference.sim latencies must be >= 0"),
            (self.step_base_s + self.step_per_token_s > 0,
             "a simulated decode step must take some time (inference.sim step_base_s + step_per_token_s > 0)"),
            (self.time_scale > 0, f"inference.sim.time_scale must be > 0, got {self.time_scale}"),
            (self.len_median >= 1 and self.len_sigma >= 0,
             "inference.sim.len_median must be >= 1 and len_sigma >= 0"),
            (self.vocab_size >= 2, f"inference.sim.vocab_size must be >= 2, got {self.vocab_size}"),
        ])


@dataclasses.dataclass
class SGLangConfig:
    """One SGLang server per inference worker (GPU in production; the CPU recipe in tests)."""

    python: str = field("", "Python that runs `-m sglang.launch_server` (empty: this one).")
    args: list[str] = field(help="Extra launch_server arguments, e.g. [--tp-size,2] (device=cpu adds the CPU "
                                 "recipe's flags itself).", factory=list)
    pause_mode: PauseMode = field(PauseMode.retract, "Weight-update pause: retract (in-flight KV recomputed, cache "
                                                     "flushed), in_place (KV kept), abort (abort + resubmit prefix).")
    gpus_per_server: int = field(1, "GPUs of one server; worker i gets GPUs first+i*g .. first+i*g+g-1 "
                                    "(CUDA_VISIBLE_DEVICES); 0 leaves it unset.")
    first_gpu: int = field(0, "First GPU of the servers (1 keeps GPU 0 for the learner).")
    startup_timeout: float = field(600.0, "Seconds the server may take to become healthy.")
    request_timeout: float = field(3600.0, "Seconds one /generate call may take.")


@dataclasses.dataclass
class TorchEngineConfig:
    """The embedded torch engine (`arl/inference/torch_engine.py`)."""

    prefix_cache_tokens: int = field(32768, "Token budget of the prefix KV cache: a request extending a finished "
                                            "sequence (the next turn of a chat) prefills only its new tokens; "
                                            "least recently used evicted, cleared at every weight update; 0 = off.")
    lean_forward: bool = field(True, "Llama / Mistral / Qwen2 / Qwen3 models run through the engine's lean forward "
                                     "(the model's arithmetic without HF's per-call machinery, "
                                     "arl/inference/lean_forward.py); false: the model's own forward.")

    def __post_init__(self) -> None:
        _require([(self.prefix_cache_tokens >= 0,
                   f"inference.torch.prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}")])


class RoutingMode(enum.StrEnum):
    """How rollout workers choose an inference server for a request."""

    global_view = "global_view"  # every server's load and cached prefixes, shared by all workers (docs/routing.md)
    per_worker = "per_worker"  # each worker's own outstanding requests + sticky sessions


@dataclasses.dataclass
class RoutingConfig:
    """Where a request goes (`arl/rollout/routing.py`): one score for every rollout worker, from every server's
    published load and prefix-cache summary (`arl/inference/routing_feed.py`)."""

    mode: RoutingMode = field(RoutingMode.global_view, "global_view: score = prefill tokens a server's cache saves "
                                                       "- load_weight x its requests in flight (all workers'); "
                                                       "per_worker: each worker's own least-load + sticky sessions.")
    block_tokens: int = field(16, "Tokens per hashed prefix block in the cache summaries (both sides use it).")
    publish_interval_s: float = field(0.1, "Seconds between a server's reports (load, cache blocks added/dropped).")
    cache_tokens: int = field(-1, "Tokens of served prefixes a server reports as cached (LRU, emptied by a weight "
                                  "update): -1 = its engine's cache size (torch: prefix_cache_tokens, sim: "
                                  "cache_tokens, sglang: none); 0: report load only (routing by load + sticky).")
    load_weight: float = field(256.0, "Prefill tokens one request in flight on a server is worth in the score.")
    sticky_slack: int = field(8, "A session stays on its server unless that server has this many more requests "
                                 "in flight than the least loaded one (then the score decides).")

    def __post_init__(self) -> None:
        _require([(self.block_tokens >= 1, f"inference.routing.block_tokens must be >= 1, got {self.block_tokens}"),
                  (self.publish_interval_s > 0, "inference.routing.publish_interval_s must be > 0"),
                  (self.cache_tokens >= -1, "inference.routing.cache_tokens must be >= -1"),
                  (self.load_weight >= 0 and self.sticky_slack >= 0,
                   "inference.routing.load_weight and sticky_slack must be >= 0")])


@dataclasses.dataclass
class AutoscaleConfig:
    """Grow the inference fleet while the learner waits for data, shrink it while generation waits on the learner
    (`arl/controller/autoscale.py`); each change is an `autoscale` record and a console line."""

    enabled: bool = field(False, "Scale inference servers by rule (needs servers_per_process=1, the local launcher "
                                 "and weights.transport=disk).")
    min_servers: int = field(1, "Fewest inference servers it shrinks to.")
    max_servers: int = field(8, "Most inference servers it grows to.")
    interval_s: float = field(10.0, "Seconds of signals behind each decision.")
    cooldown_s: float = field(20.0, "Seconds after a change before the next decision.")
    learner_idle_above: float = field(0.3, "Grow when the learner waited for data more than this share of its time.")
    learner_idle_below: float = field(0.05, "Shrink only while the learner waited for data at most this share of "
                                            "its time ...")
    gate_blocked_above: float = field(0.5, "... and rollout workers waited on the staleness gate in at least this "
                                           "share of the samples (the fleet makes more than the learner takes).")
    memory_s: float = field(120.0, "Never shrink back to a size at which the learner waited for data this recently.")

    def __post_init__(self) -> None:
        _require([(1 <= self.min_servers <= self.max_servers,
                   "inference.autoscale needs 1 <= min_servers <= max_servers"),
                  (self.interval_s > 0 and self.cooldown_s >= 0,
                   "inference.autoscale.interval_s must be > 0 and cooldown_s >= 0")])


@dataclasses.dataclass
class InferenceConfig:
    backend: str = field("torch", "Engine backend (a registered name): 'torch' (embedded PyTorch engine), "
                                  "'sglang' (an SGLang server per worker, GPU) or 'sim' (simulated).")
    num_workers: int = field(1, "Number of inference worker processes.")
    max_batch_size: int = field(256, "Most sequences decoded together in one step.")
    max_context_len: int = field(256, "Prompt + generated tokens limit; longer prompts are refused.")
    device: str = field("cpu", "torch device of the embedded engine ('cpu', 'cuda', 'cuda:N').")
    dtype: ModelDType = field(ModelDType.float32, "torch backend: dtype the engine holds the model in (bfloat16 on "
                                                  "GPUs; weight updates are cast to it). sglang: pass --dtype in "
                                                  "inference.sglang.args.")
    threads: int = field(0, "torch threads per worker; 0 = share the cores between roles.")
    heartbeat_timeout: float = field(120.0, "An inference worker silent this long is named in the log, its stacks "
                                            "dumped, and it is killed and treated as dead.")
    tolerate_worker_loss: bool = field(True, "An inference worker that dies (or stops heartbeating) is dropped and "
                                             "its requests re-sent to the others, while one remains; false: fatal.")
    restart_on_failure: bool = field(True, "Restart a dropped inference worker process: it loads the newest "
                                           "weights and rejoins the routing (needs tolerate_worker_loss).")
    max_restarts: int = field(3, "Most restarts of inference worker processes in one run; later losses stay lost.")
    servers_per_process: int = field(1, "Inference servers one worker process hosts (>1: for the sim backend, "
                                        "so dozens of simulated servers fit a small machine).")
    drain_timeout_s: float = field(60.0, "A server leaving the run (`arl.ctl scale inference=-n`) gets no new "
                                         "requests and this long to finish its own; what is left is re-sent.")
    torch: TorchEngineConfig = field(factory=TorchEngineConfig)
    sim: SimEngineConfig = field(factory=SimEngineConfig)
    sglang: SGLangConfig = field(factory=SGLangConfig)
    routing: RoutingConfig = field(factory=RoutingConfig)
    autoscale: AutoscaleConfig = field(factory=AutoscaleConfig)


class JudgeMode(enum.StrEnum):
    """How the judge model gives a reward."""

    generative = "generative"
    classifier = "classifier"


@dataclasses.dataclass
class JudgeModelConfig:
    path: str = field("", "HF folder of the judge model; empty: no judge (no judge workers start).")


@dataclasses.dataclass
class JudgeConfig:
    """A frozen model as the reward (env.name=judge), served by judge workers of its own (never sent weights)."""

    mode: JudgeMode = field(JudgeMode.generative, "'generative': the judge answers `template`, the score is "
                                                  "parsed with `score_regex`; 'classifier': a sequence-"
                                                  "classification head's score of the question and answer.")
    template: str = field("Question: {question}\nAnswer: {answer}\nReference: {reference}\nScore 0-10:",
                          "generative: the judge's prompt; {question}, {answer} and {reference} are filled in.")
    chat: bool = field(False, "generative: wrap the filled template in the judge tokenizer's chat template.")
    score_regex: str = field(r"-?\d+(?:\.\d+)?", "generative: the first match (group 1 if it has one) is the "
                                                   "score.")
    score_min: float = field(0.0, "Scores are mapped to reward = (score - score_min) / (score_max - score_min), "
                                  "clipped to [0, 1].")
    score_max: float = field(10.0, "See score_min.")
    classifier_template: str = field("{question}\n{answer}", "classifier: the text the head scores.")
    max_new_tokens: int = field(16, "generative: the judge's answer budget.")
    timeout: float = field(30.0, "Seconds one judge call may take; past it the reward is `default_reward`.")
    default_reward: float = field(0.0, "Reward when the judge's answer has no score or the call failed.")
    correct_threshold: float = field(0.5, "A reward at or above this is counted `correct`.")
    model: JudgeModelConfig = field(factory=JudgeModelConfig)
    inference: InferenceConfig = field(factory=InferenceConfig)


@dataclasses.dataclass
class RolloutConfig:
    num_workers: int = field(1, "Number of rollout (agent) worker processes.")
    max_concurrent_rollouts: int = field(64, "Most prompt groups running at once, over all rollout workers.")
    trajectory_timeout: float = field(0.0, "Seconds one collect_trajectory may take before it is dropped; 0 = auto: "
                                           "per turn (agent.args max_turns/num_turns, else 1) two request deadlines "
                                           "for gen.max_new_tokens plus two env_timeouts.")
    request_timeout: float = field(0.0, "Seconds one generate request may wait for its response before it is "
                                        "aborted and re-sent elsewhere; 0 = auto: 60 s plus timeout_per_token_s per "
                                        "token of the request's max_new_tokens (long answers are not cut early).")
    timeout_per_token_s: float = field(0.1, "Auto request deadline: seconds allowed per requested new token.")
    env_timeout: float = field(60.0, "Seconds one env call (reset/step/close) may take; an overrun or exception "
                                     "drops that group with a counted reason.")
    restart_on_failure: bool = field(True, "Restart a rollout worker that dies or stops heartbeating (its "
                                           "in-flight groups are counted as lost and their budget returned).")
    max_restarts: int = field(3, "Most restarts of rollout workers in one run; one more failure stops the run.")
    heartbeat_timeout: float = field(120.0, "A rollout worker silent this long is named, its stacks dumped, "
                                            "then restarted (or the run stops).")
    drain_timeout_s: float = field(120.0, "A rollout worker leaving the run (`arl.ctl scale rollout=-n`, or a "
                                          "SIGTERM) asks for no new groups and finishes its running ones for at "
                                          "most this long, then stops; its prompt streams go on at a worker that "
                                          "stays (what it had not finished is drawn again there).")
    num_env_groups: int = field(0, "Env groups over all rollout workers, pooled and reused with reset (ROLL "
                                   "style); 0: a fresh env group per prompt group.")
    group_size: int = field(0, "Envs per group = trajectories per prompt, same env config and seed within a "
                               "group; 0: agent.group_size.")
    tags: list[str] = field(help="Env types of the groups (registered env names or env_configs keys); empty: "
                                 "[env.name].", factory=list)
    num_groups_partition: list[int] = field(help="Env groups per tag (sums to num_env_groups); empty: even split.",
                                            factory=list)
    max_env_num_per_worker: int = field(0, "Most env instances one rollout worker may hold; 0: no limit.")
    env_configs: dict[str, Any] = field(help="Per-tag env: {tag: {name: registered env, args: {...}}}.",
                                        factory=dict)
    filter_void_turns: bool = field(False, "Drop trajectories with a void turn (no tool call and no answer, or EOS "
                                           "inside an unclosed call; agents report metadata void_turns).")
    filter_uniform_groups: bool = field(False, "Drop groups whose rewards are all equal (no group advantage).")
    verify_token_ledger: bool = field(False, "Check every trajectory is exactly the engine's tokens plus the "
                                             "agent's declared insertions; a drift stops the run.")
    max_no_progress_s: float = field(300.0, "Stop the run (exit non-zero) when no prompt group was accepted and no "
                                            "learner step made for this many seconds, naming the top drop reason and "
                                            "its newest error, or with no drops what each role is doing; evaluations "
                                            "and warm-up do not count. Raise it if one group or one learner step "
                                            "takes longer. 0: never.")
    max_consecutive_drops: int = field(200, "Stop the run when this many prompt groups in a row were dropped for "
                                            "the same reason (errors, timeouts, bad rewards, the void-turn filter; "
                                            "groups filtered for equal rewards do not count). 0: never.")
    endpoint_port: int = field(0, "Port of each rollout worker's OpenAI-compatible endpoint (agents registered as "
                                  "async functions, docs/openai_endpoint.md); 0: a free port. It binds on bind_host "
                                  "(loopback by default); rollout worker i listens on endpoint_port + i.")
    max_concurrent_sessions: int = field(0, "Most agent sessions (endpoint agents' trajectories) one rollout worker "
                                            "runs at once; the rest wait in order, admitted. 0 = auto: no cap for "
                                            "agents given an in-process client (client / anthropic) or running "
                                            "outside the run (external), 4 per CPU for agents that take base_url / "
                                            "api_key (a process or HTTP client each).")
    task_api_key: str = field("", "agent.name=external: the key agents outside the run present to the task API "
                                  "(/rl/v1/episodes); empty: a random one, written with each worker's address to "
                                  "<run_dir>/task_api/rollout<i>.json. Never the run's secret.")
    tool_parser: str = field("auto", "Tool-call parser of the endpoint's answers and of agents that take a `parser` "
                                     "(hermes, qwen3, qwen3_coder, llama3_json, mistral, or one registered with "
                                     "arl.tools.parsers.PARSERS.register); auto: the one the chat template's own "
                                     "markers name (hermes when it names none).")
    trace_rate: float = field(0.05, "Share of prompt groups written to traces.jsonl (decoded turns, versions, "
                                    "timings); groups an error or a filter touched are always traced.")
    loop_block_warn_s: float = field(1.0, "Warn, naming the agent and the loop thread's stack, and count it in the "
                                          "heartbeat, when a rollout worker's event loop does not run for this many "
                                          "seconds (a synchronous call in an agent: openai.OpenAI instead of "
                                          "AsyncOpenAI, time.sleep). 0: no watchdog.")


class LossAgg(enum.StrEnum):
    token = "token"  # mean over every loss token of the batch
    seq = "seq"  # mean over sequences of each sequence's token mean


class KLEstimator(enum.StrEnum):
    k1 = "k1"  # logp - ref
    k3 = "k3"  # exp(ref - logp) - (ref - logp) - 1


class StaleTokens(enum.StrEnum):
    keep = "keep"
    drop = "drop"
    downweight = "downweight"


class Correction(enum.StrEnum):
    """Off-policy corrections of the objective (`learner.ppo.correction`, a list; docs/learner.md has the formulas).

    Each names which of three slots it fills: the behaviour weight ``w = pi_prox / pi_behav`` (at most one of
    `WEIGHTS`), masks on ``w`` (any of `MASKS`), the policy term on ``r = pi / pi_old`` (at most one of
    `OBJECTIVES`; none: PPO's clip)."""

    tis = "tis"  # token truncated IS: w -> min(w, tis_cap)
    seq_tis = "seq_tis"  # sequence truncated IS: every token of a sequence weighted min(prod w, seq_threshold)
    mis = "mis"  # token masked IS: tokens with w outside [1/mis_threshold, mis_threshold] leave the loss
    seq_mis = "seq_mis"  # sequences with prod w outside [1/seq_threshold, seq_threshold] leave the loss
    geo_mask = "geo_mask"  # sequences whose geometric-mean w leaves [1/geo_threshold, geo_threshold] leave it
    icepop = "icepop"  # tokens with w outside icepop_band leave the loss (IcePop)
    cispo = "cispo"  # -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp on every token (CISPO)
    gspo = "gspo"  # sequence ratio exp(mean log r), clipped by gspo_eps (GSPO)


CORRECTION_WEIGHTS = (Correction.tis, Correction.seq_tis)
CORRECTION_MASKS = (Correction.mis, Correction.seq_mis, Correction.geo_mask, Correction.icepop)
CORRECTION_OBJECTIVES = (Correction.cispo, Correction.gspo)


class LRSchedule(enum.StrEnum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class PackedAttention(enum.StrEnum):
    varlen = "varlen"  # per-sequence SDPA over the packed row
    mask = "mask"  # transformers' block-diagonal mask from restarting position ids


@dataclasses.dataclass
class PPOConfig:
    """The algorithm: decoupled PPO with group-normalised advantages (the PPO actor consumes this whole)."""

    eps_clip: float = field(0.2, "PPO clip range.")
    behav_imp_weight_cap: Optional[float] = field(5.0, "Decoupled PPO: tokens with behaviour weight above this are "
                                                       "masked (null: no cap).")
    naive_ppo: bool = field(False, "Use standard PPO against behaviour logprobs (staleness ablation).")
    minibatches: int = field(4, "Optimizer steps per batch: after one proximal-logprob recompute the batch is split "
                                "into this many minibatches (equal tokens), one step each. > 1 gives the decoupled "
                                "clip a trust region to enforce (AReaL's ppo_n_minibatches); 1 makes the ratio "
                                "exactly 1 where the gradient is taken, so the clip never binds.")
    adv_std_norm: bool = field(True, "Divide group advantages by the group std.")
    dual_clip_c: Optional[float] = field(None, "Dual-clip PPO bound c > 1 for negative advantages (null: off).")
    loss_agg: LossAgg = field(LossAgg.token, "Loss aggregation: 'token' (mean over tokens) or 'seq' (mean of "
                                             "sequence means).")
    kl_coef: float = field(0.0, "KL penalty to the initial weights (0: off): a frozen copy of them, or with "
                                "learner.lora the base model with the adapters disabled (no copy).")
    kl_estimator: KLEstimator = field(KLEstimator.k1, "KL estimator: 'k1' (logp - ref) or 'k3' "
                                                      "(exp(ref-logp) - (ref-logp) - 1).")
    turn_discount: Optional[float] = field(None, "Per-turn advantages from turn_rewards with this discount for "
                                                 "every trajectory (null: as each trajectory's agent says in its "
                                                 "turn_discount; none said: one advantage per trajectory).")
    stale_tokens: StaleTokens = field(StaleTokens.keep, "Tokens older than v - eta at consumption: 'keep', 'drop' "
                                                        "or 'downweight'.")
    stale_token_decay: float = field(0.5, "downweight: weight decay ** (lag - eta) for stale tokens (in [0, 1]).")
    correction: list[str] = field(
        help="Off-policy corrections, composable (docs/learner.md, 'Corrections'): at most one behaviour weight "
             "(tis, seq_tis), any masks (mis, seq_mis, geo_mask, icepop), at most one policy term (cispo, gspo). "
             "[]: AReaL's decoupled PPO (the behav_imp_weight_cap filter).", factory=list)
    tis_cap: float = field(2.0, "tis: the behaviour weight is truncated at this (> 1).")
    mis_threshold: float = field(2.0, "mis: tokens whose behaviour weight leaves [1/t, t] are masked (> 1).")
    seq_threshold: float = field(2.0, "seq_tis: the sequence weight is truncated at this; seq_mis: sequences whose "
                                      "weight leaves [1/t, t] are masked (> 1).")
    geo_threshold: float = field(1.01, "geo_mask: sequences whose geometric-mean behaviour weight leaves [1/t, t] "
                                       "are masked (> 1; verl's 1.0002-1.001 is for same-version mismatch alone).")
    icepop_band: list[float] = field(help="icepop: tokens whose behaviour weight leaves [low, high] are masked.",
                                     factory=lambda: [0.5, 5.0])
    cispo_eps: list[float] = field(help="cispo: the IS weight is clipped to [1 - low, 1 + high] (low 1: no lower "
                                        "bound, as MiniMax-M1).", factory=lambda: [1.0, 4.0])
    gspo_eps: list[float] = field(help="gspo: the sequence ratio is clipped to [1 - low, 1 + high] (the GSPO "
                                       "paper's 3e-4 / 4e-4).", factory=lambda: [3e-4, 4e-4])
    mismatch_log_ratio: float = field(0.5, "The mismatch monitor counts a same-version token whose |log pi_learner "
                                           "- log pi_engine| exceeds this (mismatch_frac).")

    def __post_init__(self) -> None:
        """Checked once, here: both the command line and code that builds the section directly come through."""
        self.loss_agg = LossAgg(self.loss_agg)
        self.kl_estimator = KLEstimator(self.kl_estimator)
        self.stale_tokens = StaleTokens(self.stale_tokens)
        self.correction = check_corrections(self.correction, naive=self.naive_ppo)
        band, ce, ge = list(self.icepop_band), list(self.cispo_eps), list(self.gspo_eps)
        _require([
            (self.tis_cap > 1.0, f"learner.ppo.tis_cap must be > 1, got {self.tis_cap}"),
            (self.mis_threshold > 1.0, f"learner.ppo.mis_threshold must be > 1, got {self.mis_threshold}"),
            (self.seq_threshold > 1.0, f"learner.ppo.seq_threshold must be > 1, got {self.seq_threshold}"),
            (self.geo_threshold > 1.0, f"learner.ppo.geo_threshold must be > 1, got {self.geo_threshold}"),
            (len(band) == 2 and 0.0 <= band[0] < 1.0 < band[1],
             f"learner.ppo.icepop_band must be [low, high] with 0 <= low < 1 < high, got {band}"),
            (len(ce) == 2 and 0.0 < ce[0] <= 1.0 and ce[1] > 0.0,
             f"learner.ppo.cispo_eps must be [low, high] with 0 < low <= 1 and high > 0, got {ce}"),
            (len(ge) == 2 and 0.0 < ge[0] < 1.0 and ge[1] > 0.0,
             f"learner.ppo.gspo_eps must be [low, high] with 0 < low < 1 and high > 0, got {ge}"),
            (self.mismatch_log_ratio > 0.0,
             f"learner.ppo.mismatch_log_ratio must be > 0, got {self.mismatch_log_ratio}"),
        ])
        _require([
            (isinstance(self.minibatches, int) and self.minibatches >= 1,
             f"learner.ppo.minibatches must be an int >= 1, got {self.minibatches!r}"),
            (self.behav_imp_weight_cap is None or self.behav_imp_weight_cap > 1.0,
             f"learner.ppo.behav_imp_weight_cap must be > 1 (or null), got {self.behav_imp_weight_cap}"),
            (self.dual_clip_c is None or self.dual_clip_c > 1.0,
             f"learner.ppo.dual_clip_c must be > 1 (or null), got {self.dual_clip_c}"),
            (self.turn_discount is None or 0.0 <= self.turn_discount <= 1.0,
             f"learner.ppo.turn_discount must be in [0, 1] (or null), got {self.turn_discount}"),
        ])


def check_corrections(names: Sequence[str], naive: bool = False) -> list[str]:
    """`learner.ppo.correction` as a list of `Correction` names, or a ConfigError that says what is wrong: an unknown
    name (with the close ones), two in one exclusive slot, or a correction of the behaviour weight with naive PPO
    (which has no proximal policy to weigh against)."""
    if isinstance(names, str):
        names = [n for n in names.replace(",", " ").split() if n]
    out: list[str] = []
    for n in names:
        try:
            c = Correction(str(n))
        except ValueError:
            close = difflib.get_close_matches(str(n), [c.value for c in Correction], n=3)
            raise ConfigError(f"learner.ppo.correction: unknown correction {n!r}"
                              + (f" (did you mean {', '.join(close)}?)" if close else "")
                              + f"; known: {', '.join(c.value for c in Correction)}") from None
        if c.value in out:
            raise ConfigError(f"learner.ppo.correction names {c.value!r} twice")
        out.append(c.value)
    for slot, members in (("behaviour weight", CORRECTION_WEIGHTS), ("policy term", CORRECTION_OBJECTIVES)):
        both = [x for x in out if x in members]
        if len(both) > 1:
            raise ConfigError(f"learner.ppo.correction: {' and '.join(both)} both set the {slot}; choose one")
    on_w = [x for x in out if x in CORRECTION_WEIGHTS or x in CORRECTION_MASKS]
    if naive and on_w:
        raise ConfigError(f"learner.ppo.correction: {', '.join(on_w)} correct the behaviour weight pi_prox / "
                          f"pi_behav, which naive_ppo does not have (it has no proximal policy); drop naive_ppo or "
                          f"use cispo / gspo alone")
    return out


@dataclasses.dataclass
class OptimizerConfig:
    """AdamW and its learning-rate schedule (the training engine consumes this whole)."""

    lr: float = field(1e-4, "AdamW learning rate.")
    betas: list[float] = field(help="AdamW betas.", factory=lambda: [0.9, 0.99])
    weight_decay: float = field(0.0, "AdamW weight decay.")
    grad_clip: float = field(1.0, "Gradient clipping norm (0: off).")
    lr_schedule: LRSchedule = field(LRSchedule.constant, "LR schedule after warm-up: 'constant', 'linear' or "
                                                         "'cosine' (to min_lr_ratio at the last optimizer step).")
    warmup_steps: int = field(0, "Linear LR warm-up steps.")
    min_lr_ratio: float = field(0.0, "linear/cosine: final LR as a fraction of lr.")


@dataclasses.dataclass
class DeepSpeedConfig:
    """DeepSpeed mechanics and micro-batching of the training engine."""

    zero_stage: int = field(0, "DeepSpeed ZeRO stage (0-3).")
    offload_optimizer: bool = field(False, "Offload optimizer states to CPU (needs zero_stage >= 1).")
    bf16: bool = field(False, "Train in bf16.")
    max_tokens_per_mb: int = field(4096, "Token budget of one micro-batch.")
    packing: bool = field(True, "Pack sequences without padding into micro-batches (false: right padding).")
    packed_attention: PackedAttention = field(PackedAttention.varlen, "Packed rows: 'varlen' (per-sequence SDPA) or "
                                                                      "'mask' (transformers' block-diagonal mask).")
    share_prefixes: bool = field(True, "Packed varlen rows run each prefix their sequences share once (a group's "
                                       "chains: the prompt, often the first turns); same logits and gradients.")

    def __post_init__(self) -> None:
        self.packed_attention = PackedAttention(self.packed_attention)
        _require([
            (self.zero_stage in (0, 1, 2, 3), f"learner.deepspeed.zero_stage must be in 0..3, got {self.zero_stage}"),
            (not self.offload_optimizer or self.zero_stage >= 1,
             "learner.deepspeed.offload_optimizer needs learner.deepspeed.zero_stage >= 1"),
        ])


@dataclasses.dataclass
class SimLearnerConfig:
    """The simulated learner (benchmarks): sleeps per batch token instead of training."""

    s_per_token: float = field(1.0e-5, "Seconds per batch token (7B on 8 H100s, NeMo fit).")
    step_base_s: float = field(0.5, "Fixed seconds per step (optimizer step, export).")
    time_scale: float = field(1.0, "Multiplies its simulated durations.")

    def __post_init__(self) -> None:
        _require([(self.s_per_token >= 0 and self.step_base_s >= 0 and self.time_scale > 0,
                   "learner.sim: s_per_token and step_base_s must be >= 0 and time_scale > 0")])


@dataclasses.dataclass
class LoraConfig:
    """LoRA adapters (peft): the learner trains only them, inference gets only them (the training engine consumes
    this whole)."""

    rank: int = field(0, "LoRA rank r (0: off, full fine-tuning). > 0: the learner wraps the model with peft "
                         "(pip install 'arl[lora]') and trains only the adapters.")
    alpha: float = field(16.0, "LoRA alpha: the update is scaled by alpha / rank.")
    dropout: float = field(0.0, "LoRA dropout (in [0, 1); the learner runs in eval mode, so it is inactive).")
    lr_scale: float = field(10.0, "The adapters train at learner.optimizer.lr x lr_scale (modules_to_save at "
                                  "learner.optimizer.lr): adapters want about 10x full fine-tuning's rate "
                                  "(docs/learner.md, LoRA). 1: the same rate.")
    target_modules: list[str] = field(help="Module names (suffixes, as peft matches them) that get adapters.",
                                      factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    modules_to_save: list[str] = field(help="Modules trained in full beside the adapters (e.g. [lm_head]); their "
                                            "tensors travel with each update.", factory=list)

    def __post_init__(self) -> None:
        _require([
            (isinstance(self.rank, int) and self.rank >= 0,
             f"learner.lora.rank must be an int >= 0 (0: off), got {self.rank!r}"),
            (self.alpha > 0, f"learner.lora.alpha must be > 0, got {self.alpha}"),
            (0.0 <= self.dropout < 1.0, f"learner.lora.dropout must be in [0, 1), got {self.dropout}"),
            (self.lr_scale > 0, f"learner.lora.lr_scale must be > 0, got {self.lr_scale}"),
            (self.rank == 0 or len(self.target_modules) > 0, "learner.lora.target_modules must name a module"),
        ])

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclasses.dataclass
class LearnerConfig:
    backend: str = field("deepspeed", "Training engine (a registered name): 'deepspeed' (trains the model) or "
                                      "'sim' (sleeps per token, benchmarks).")
    batch_size: int = field(16, "B: prompt groups per training step.")
    num_ranks: int = field(1, "Learner data-parallel ranks (DeepSpeed over gloo on CPU); each takes whole groups.")
    device: LearnerDevice = field(LearnerDevice.auto, "Where the learner trains. DeepSpeed places rank r on GPU r "
                                                      "(LOCAL_RANK) when CUDA is visible, else on the CPU; 'cuda' or "
                                                      "'cpu' makes the learner fail at start-up if it landed "
                                                      "elsewhere (a GPU run silently training on the CPU). Dtype: "
                                                      "learner.deepspeed.bf16.")
    threads: int = field(0, "torch threads of the learner; 0 = share the cores between roles.")
    keep_weight_versions: int = field(3, "Floor: the newest N exported weight files are always kept; older ones "
                                         "are deleted once every live inference worker acked a newer version.")
    heartbeat_timeout: float = field(120.0, "A learner silent this long is named in the log, its stacks dumped, "
                                            "and it is restarted (learner.max_restarts).")
    max_restarts: int = field(3, "Most restarts of a lost learner (died, silent, or reported a fatal error) in one "
                                 "run, each from the newest checkpoint (version 0 without one) while inference "
                                 "and rollout workers keep running; one more loss stops the run (0: a lost "
                                 "learner stops the run).")
    checkpoint_every: int = field(50, "Checkpoint (model, optimizer, scheduler, RNG, data position) every N steps "
                                      "and after the last one, under <run>/checkpoints (0: never).")
    keep_checkpoints: int = field(2, "Checkpoints kept in the run directory.")
    record_batches: bool = field(False, "Write every trained batch (token ids, loss masks, behaviour logprobs, "
                                        "versions, rewards, group ids, in order) to <run>/batches/v<N>.npz, so "
                                        "scripts/replay.py can re-train steps between two kept checkpoints bit for "
                                        "bit or re-score a trajectory; off: nothing is recorded.")
    ppo: PPOConfig = field(factory=PPOConfig)
    optimizer: OptimizerConfig = field(factory=OptimizerConfig)
    deepspeed: DeepSpeedConfig = field(factory=DeepSpeedConfig)
    sim: SimLearnerConfig = field(factory=SimLearnerConfig)
    lora: LoraConfig = field(factory=LoraConfig)


@dataclasses.dataclass
class WeightsConfig:
    """How new weights travel from the learner to the inference workers."""

    transport: str = field("disk", "'disk': the learner writes weights/v<N>.safetensors and every worker reads it (a "
                                   "shared filesystem across hosts); 'broadcast': learner rank 0 sends them over a "
                                   "torch.distributed group per inference worker (no file); or a transport registered "
                                   "in arl.weights.strategy.TRANSPORTS.")
    backend: str = field("auto", "broadcast: 'gloo', 'nccl', or 'auto' (nccl when inference runs on CUDA, else gloo; "
                                 "disk instead when learner rank 0 and an inference server share a GPU).")
    bucket_mb: int = field(64, "broadcast: tensors travel in buckets of at most this many MiB.")
    timeout_s: float = field(120.0, "broadcast: longest wait of one group step (forming a group, one bucket).")


@dataclasses.dataclass
class ExportConfig:
    """What the learner writes to ``<run>/final/`` after the last step."""

    merge_lora: bool = field(False, "With learner.lora: besides the adapter (final/, a peft folder), write the base "
                                    "with the adapter merged in as a save_pretrained model (final/merged/).")


class LauncherKind(enum.StrEnum):
    local = "local"
    ray = "ray"


@dataclasses.dataclass
class RayConfig:
    """`launcher=ray`: where the roles run. pip install 'arl[ray]'."""

    address: str = field("local", "'local': start a Ray instance for this run; 'auto': the cluster this machine "
                                  "belongs to (`ray start`); 'ray://host:port' or 'host:port': that cluster.")
    num_cpus: int = field(0, "address=local: CPUs Ray may schedule (0: all of this machine's).")
    placement: dict[str, Any] = field(help="Which nodes get which roles, by Ray custom resources: role (inference, "
                                           "rollout, learner, env) -> {resource: amount} for all its processes, or a "
                                           "list of such maps, one per process (learner: per rank; the last "
                                           "repeats). E.g. {inference: {node_a: 0.01}, learner: [{node_b: 0.01}, "
                                           "{node_a: 0.01}]}.", factory=dict)
    cpus_per_inference: float = field(1.0, "CPUs in each inference process's bundle.")
    gpus_per_inference: float = field(0.0, "GPUs per inference server (times inference.servers_per_process).")
    cpus_per_rollout: float = field(1.0, "CPUs in each rollout worker's bundle.")
    cpus_per_env: float = field(1.0, "CPUs in each env server's bundle (env.servers; ray.placement.env picks its "
                                     "nodes, e.g. CPU-only ones).")
    cpus_per_learner_rank: float = field(1.0, "CPUs in each learner rank's bundle.")
    gpus_per_learner_rank: float = field(0.0, "GPUs in each learner rank's bundle.")
    strategy: str = field("PACK", "Placement strategy of the learner ranks' group: PACK, SPREAD, STRICT_PACK or "
                                  "STRICT_SPREAD.")
    env_vars: dict[str, str] = field(help="Environment variables set in every role process, on whatever node it "
                                          "runs (as Ray's runtime_env env_vars): e.g. {HF_HOME: /data/hf, "
                                          "PYTHONPATH: /code/agents} for `imports=` found on the nodes. A role's "
                                          "own variables (the run's secret, ranks) win.", factory=dict)


@dataclasses.dataclass
class EvalConfig:
    every_n_steps: int = field(25, "Greedy evaluation on the held-out split every N steps (0: only start/end).")
    max_prompts: int = field(200, "Held-out prompts per evaluation (0: all).")
    concurrency: int = field(64, "Evaluation prompts in flight at once.")


class Recover(enum.StrEnum):
    off = "off"
    auto = "auto"


@dataclasses.dataclass
class StalenessAutoConfig:
    """`max_head_offpolicyness=auto`: the controller steers the admitted eta between `eta_min` and `eta_max` by the
    learner's health signals (`arl.controller.steering`; docs/learner.md, 'A staleness budget that steers itself')."""

    eta_min: int = field(1, "The lowest eta the controller admits at.")
    eta_max: int = field(8, "The highest eta it admits at: the learner's bound (groups older are dropped).")
    eta_start: int = field(1, "The eta the run starts at (the safest: early steps move the policy most; it "
                                  "rises while the learner stays healthy).")
    raise_after: int = field(10, "Healthy steps in a row before eta goes up by one (and after any change).")
    mismatch_kl_max: float = field(0.01, "Unhealthy when the step's mismatch_kl exceeds this (prime-rl asks a "
                                         "model for < 0.015).")
    clip_frac_max: float = field(0.05, "Unhealthy when the step's clip_frac exceeds this.")
    capped_frac_max: float = field(0.02, "Unhealthy when the step's capped_frac (tokens masked by the behaviour "
                                         "cap or a correction) exceeds this.")
    grad_norm_spike: float = field(5.0, "Unhealthy when the step's grad_norm exceeds this times the median of the "
                                        "last `window` steps (0: off).")
    window: int = field(20, "Steps in the grad_norm median.")
    smooth: int = field(5, "mismatch_kl, clip_frac and capped_frac are judged on their mean over this many steps.")


@dataclasses.dataclass
class PolicyConfig:
    """A named policy served beside the run's own (docs/multi_policy.md): a LoRA adapter on the run's base model,
    served by every inference server; frozen (an opponent, a reference), or trained by a learner of its own."""

    name: str = field("", "Its name: a request's `GenerateRequest.policy` and an endpoint request's `model` select "
                          "it (a letter or digit, then letters, digits, '_', '.', '-'; at most 64).")
    adapter: str = field("", "A peft LoRA folder (adapter_config.json + adapter_model.safetensors) on the run's "
                             "base model: the policy's weights. 'base': no delta, the base model itself, which in a "
                             "LoRA run is the run's policy as it started (peft starts B at zero): the frozen start "
                             "a self-play run is measured against.")
    trainable: bool = field(False, "Train it too, separately: a learner role of its own (`learner<k>`, k its place "
                                   "among the trainable ones) trains its tokens only, from `adapter: base` (a "
                                   "fresh adapter on the run's base) with its own versions, and publishes them to "
                                   "every inference server by name. False: served frozen.")
    servers: list[int] = field(help="The inference servers that serve it (indices < inference.num_workers); "
                                    "empty: every server. A request of this policy goes only to these.",
                               factory=list)
    learner: dict[str, Any] = field(help="A trainable policy's learner section: keys of the run's `learner` it "
                                         "sets otherwise, e.g. {optimizer: {lr: 1e-4}} (the rest is the run's).",
                                    factory=dict)


OWN_POLICY = "policy"  # the run's own policy's name, never a listed one's
BASE_ADAPTER = "base"  # a listed policy's adapter: the base model itself (arl.weights.adapter.base_payload)


@dataclasses.dataclass
class ExperimentConfig:
    experiment: str = field("async-ppo-math", "Registered experiment name.")
    run_dir: str = field("runs", "Parent directory of run directories.")
    run_name: str = field("", "Run directory name; empty: experiment name + timestamp.")
    seed: int = field(1, "Global seed.")
    total_train_steps: int = field(400, "Learner steps in the run.")
    max_head_offpolicyness: Any = field(2, "eta: the most policy versions a consumed token may lag behind (an int "
                                           ">= 0), or 'auto': the controller steers it (staleness_auto.*).")
    imports: list[str] = field(help="Modules every role imports at start-up (user agents/envs).", factory=list)
    startup_timeout: float = field(300.0, "Seconds the roles may take to start and register.")
    bind_host: str = field("127.0.0.1", "Interface every socket binds to; not loopback (a multi-host run) "
                                        "requires `secret`.")
    secret: str = field("", "Shared secret: every frame carries an HMAC-SHA256 tag and frames without a valid one "
                            "are dropped and counted. Env ARL_SECRET works too (and stays out of config.yaml).")
    max_message_bytes: int = field(64 * 1024 * 1024, "Largest frame a socket accepts; bigger ones are dropped and "
                                                     "counted (libzmq cuts peers sending over twice this).")
    busy_poll_us: float = field(0.0, "Microseconds each role's event loop keeps polling its sockets before it "
                                     "sleeps: lower round-trip latency at low load on hosts where waking an idle "
                                     "core is slow (VMs), for up to this much CPU per idle period. 0 = off.")
    progress: bool = field(True, "Show a progress bar.")
    loggers: list[str] = field(help="Experiment trackers besides metrics.jsonl (always written): tensorboard, wandb "
                                    "(offline unless WANDB_MODE says otherwise), mlflow (MLFLOW_TRACKING_URI, else a "
                                    "file store in the run directory). pip install 'arl[trackers]'.",
                               factory=list)
    staleness_auto: StalenessAutoConfig = field(factory=StalenessAutoConfig)
    recover: Recover = field(Recover.off, "'auto': resume from the latest checkpoint in the run directory (set "
                                          "run_name to the run to resume); 'off': start fresh.")
    model: ModelConfig = field(factory=ModelConfig)
    dataset: DatasetConfig = field(factory=DatasetConfig)
    gen: GenerationArgs = field(factory=GenerationArgs)
    agent: AgentConfig = field(factory=AgentConfig)
    env: EnvConfig = field(factory=EnvConfig)
    inference: InferenceConfig = field(factory=InferenceConfig)
    judge: JudgeConfig = field(factory=JudgeConfig)
    rollout: RolloutConfig = field(factory=RolloutConfig)
    learner: LearnerConfig = field(factory=LearnerConfig)
    eval: EvalConfig = field(factory=EvalConfig)
    weights: WeightsConfig = field(factory=WeightsConfig)
    export: ExportConfig = field(factory=ExportConfig)
    policies: list[PolicyConfig] = field(help="Named policies served beside the run's own (LoRA adapters on its "
                                              "base; the run's own then trains LoRA), frozen or, with trainable: "
                                              "true, trained by a learner of their own: e.g. "
                                              "policies='[{name: opponent, adapter: /path/to/peft}]'. "
                                              "docs/multi_policy.md.", factory=list)
    launcher: LauncherKind = field(LauncherKind.local, "'local': every role is a process on this machine; 'ray': "
                                                       "every role runs on a Ray node (see ray.*), the controller "
                                                       "here.")
    ray: RayConfig = field(factory=RayConfig)


def _field_rows(obj: Any, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    rows = []
    for f in dataclasses.fields(obj):
        val = getattr(obj, f.name)
        if dataclasses.is_dataclass(val):
            rows += _field_rows(val, prefix + f.name + ".")
        else:
            if isinstance(val, enum.Enum):  # a choice: show the choices, not the class name
                tname, val = "|".join(m.value for m in type(val)), val.value
            else:
                tname = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            rows.append((prefix + f.name, str(tname), val, f.metadata.get("help", "")))
    return rows


def format_help(config_cls: type = ExperimentConfig) -> str:
    lines = [
        "usage: python training/main_async_ppo.py [experiment=NAME] [key=value ...] [a.b.c=value ...]",
        "",
        f"Fields of {config_cls.__name__} (key: type = default  help):",
    ]
    for key, tname, default, help_text in _field_rows(config_cls()):
        lines.append(f"  {key}: {tname} = {default!r}\n      {help_text}")
    return "\n".join(lines)


def _close_matches(key: str, cls: type) -> list[str]:
    """Keys whose last part looks like the typo's (a key that moved into a section is found too), then keys that
    look like the whole of it."""
    keys = [k for k, *_ in _field_rows(cls())]
    keys += sorted({k.rsplit(".", 1)[0] for k in keys if "." in k})  # the sections too
    leaf = key.split(".")[-1]
    matches = [k for m in difflib.get_close_matches(leaf, [k.split(".")[-1] for k in keys], n=3, cutoff=0.75)
               for k in keys if k.split(".")[-1] == m]
    matches += difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    return list(dict.fromkeys(matches))[:5]


def split_experiment(argv: Sequence[str]) -> tuple[Optional[str], list[str]]:
    """Pull `experiment=NAME` out of argv (it selects the dataclass the rest is merged into)."""
    names = [a.split("=", 1)[1] for a in argv if a.startswith("experiment=")]  # the last one wins
    return (names[-1] if names else None), [a for a in argv if not a.startswith("experiment=")]


def parse_overrides(config_cls: type, overrides: Sequence[str], base: Any = None) -> Any:
    """Merge `key=value` overrides into `config_cls` defaults; returns a plain dataclass instance."""
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(f"arguments must look like key=value, got {bad}")
    schema = OmegaConf.structured(base if base is not None else config_cls)
    try:
        cli = OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as e:
        raise ConfigError(f"could not parse arguments {list(overrides)}: {e}") from None
    try:
        merged = OmegaConf.merge(schema, cli)
    except (ConfigKeyError, ConfigAttributeError) as e:
        key = getattr(e, "full_key", None) or str(e)
        given = (o.split("=", 1)[0] for o in overrides)
        key = next((g for g in given if g == key or g.startswith(key + ".")), key)
        hint = _close_matches(key, config_cls)
        did_you_mean = f"; did you mean: {', '.join(hint)}?" if hint else ""
        raise ConfigError(f"unknown config key '{key}'{did_you_mean} (see --help for every field)") from None
    except ValidationError as e:
        key = getattr(e, "full_key", "?")
        expected = next((tname for k, tname, *_ in _field_rows(config_cls()) if k == key), "a different type")
        raise ConfigError(f"bad value for '{key}': expected {expected} ({e.msg.splitlines()[0]})") from None
    obj = OmegaConf.to_object(merged)
    validate(obj)
    return obj


# Env groups' layout (`arl.rollout.env_groups`): here because validate checks it before any process starts.

def partition_groups(num_env_groups: int, tags: Sequence[str],
                     num_groups_partition: Optional[Sequence[int]] = None) -> list[str]:
    """The tag of each global group index. Default partition: as even as possible, earlier tags first."""
    if num_env_groups < 1:
        raise ValueError(f"num_env_groups must be >= 1, got {num_env_groups}")
    tags = list(tags)
    if not tags:
        raise ValueError("env groups need at least one tag")
    if len(set(tags)) != len(tags):
        raise ValueError(f"tags must be unique, got {tags}")
    if num_groups_partition:
        parts = [int(n) for n in num_groups_partition]
        if len(parts) != len(tags):
            raise ValueError(f"num_groups_partition has {len(parts)} entries for {len(tags)} tags {tags}")
        if any(n < 0 for n in parts) or sum(parts) != num_env_groups:
            raise ValueError(f"num_groups_partition {parts} must be non-negative and sum to num_env_groups="
                             f"{num_env_groups}")
    else:
        base, rest = divmod(num_env_groups, len(tags))
        parts = [base + (i < rest) for i in range(len(tags))]
    return [t for t, n in zip(tags, parts) for _ in range(n)]


def worker_groups(num_env_groups: int, num_workers: int, worker: int) -> list[int]:
    """Global group indices hosted by rollout worker `worker` (round robin)."""
    return list(range(worker, num_env_groups, num_workers))


def check_env_capacity(num_env_groups: int, num_workers: int, group_size: int, max_env_num_per_worker: int) -> None:
    """Raise ValueError if some worker would hold more than `max_env_num_per_worker` env instances."""
    if max_env_num_per_worker <= 0 or num_env_groups <= 0:
        return
    most = max(len(worker_groups(num_env_groups, num_workers, w)) for w in range(num_workers))
    if most * group_size > max_env_num_per_worker:
        raise ValueError(
            f"env groups: a rollout worker would hold {most} groups x {group_size} envs = {most * group_size} > "
            f"max_env_num_per_worker={max_env_num_per_worker}; raise rollout.num_workers or "
            f"max_env_num_per_worker, or lower num_env_groups")


def validate(cfg: Any) -> None:
    """Cross-field checks that types alone cannot express."""
    if not isinstance(cfg, ExperimentConfig):
        return
    lc, ic, rc = cfg.learner, cfg.inference, cfg.rollout
    try:  # eta, stale_tokens and their decay are checked where the rule lives
        staleness_policy(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    checks = [
        (cfg.total_train_steps >= 1, "total_train_steps must be >= 1"),
        (lc.batch_size >= 1, "learner.batch_size must be >= 1"),
        (cfg.agent.group_size >= 1, "agent.group_size must be >= 1"),
        (ic.num_workers >= 1, "inference.num_workers must be >= 1"),
        (ic.servers_per_process >= 1, "inference.servers_per_process must be >= 1"),
        (lc.num_ranks >= 1, "learner.num_ranks must be >= 1"),
        (lc.batch_size >= lc.num_ranks,
         "learner.batch_size must be >= learner.num_ranks (every rank trains on whole prompt groups)"),
        (lc.checkpoint_every >= 0, "learner.checkpoint_every must be >= 0"),
        (rc.num_workers >= 1, "rollout.num_workers must be >= 1"),
        (rc.max_concurrent_rollouts >= 1, "rollout.max_concurrent_rollouts must be >= 1"),
        (rc.env_timeout > 0, "rollout.env_timeout must be > 0"),
        (cfg.env.servers >= 0 and cfg.env.max_restarts >= 0, "env.servers and env.max_restarts must be >= 0"),
        (cfg.env.call_timeout >= 0 and cfg.env.session_lease_s > 0 and cfg.env.heartbeat_timeout > 0,
         "env.call_timeout must be >= 0, env.session_lease_s and env.heartbeat_timeout > 0"),
        (rc.max_restarts >= 0, "rollout.max_restarts must be >= 0"),
        (ic.max_restarts >= 0, "inference.max_restarts must be >= 0"),
        (lc.max_restarts >= 0, "learner.max_restarts must be >= 0"),
        (min(rc.heartbeat_timeout, ic.heartbeat_timeout, lc.heartbeat_timeout) > 0,
         "heartbeat timeouts must be > 0"),
        (cfg.max_message_bytes >= 1024, "max_message_bytes must be >= 1024"),
        (cfg.ray.strategy in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
         "ray.strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD"),
        (all(isinstance(k, str) and ENV_VAR_NAME.fullmatch(k) for k in (cfg.ray.env_vars or {})),
         f"ray.env_vars: names must be environment variable names (letters, digits, _; not starting with a digit), "
         f"got {sorted(map(str, cfg.ray.env_vars or {}))}"),
        (0 <= cfg.busy_poll_us <= 100_000, "busy_poll_us must be in 0..100000"),
        (cfg.gen.max_new_tokens >= 1, "gen.max_new_tokens must be >= 1"),
        (cfg.gen.temperature > 0, "gen.temperature must be > 0"),
        (0.0 <= rc.trace_rate <= 1.0, "rollout.trace_rate must be in [0, 1]"),
        (rc.loop_block_warn_s >= 0, "rollout.loop_block_warn_s must be >= 0 (0: no loop watchdog)"),
        (rc.max_concurrent_sessions >= 0, "rollout.max_concurrent_sessions must be >= 0 (0: auto)"),
        (rc.endpoint_port == 0 or 0 < rc.endpoint_port <= 65536 - rc.num_workers,
         f"rollout.endpoint_port must be 0 (a free port) or a port with endpoint_port + rollout.num_workers - 1 <= "
         f"65535 (rollout worker i listens on endpoint_port + i), got {rc.endpoint_port} with {rc.num_workers}"),
        (min(rc.request_timeout, rc.trajectory_timeout, rc.timeout_per_token_s) >= 0,
         "rollout.request_timeout, rollout.trajectory_timeout and rollout.timeout_per_token_s must be >= 0"),
        (rc.max_no_progress_s >= 0 and rc.max_consecutive_drops >= 0,
         "rollout.max_no_progress_s and rollout.max_consecutive_drops must be >= 0"),
        (cfg.dataset.name in DATASETS, f"dataset.name must be one of {list(DATASETS)}, got {cfg.dataset.name!r}"),
        (cfg.dataset.train_size >= 1 and cfg.dataset.test_size >= 0,
         "dataset.train_size must be >= 1 and dataset.test_size >= 0"),
        (rc.num_env_groups >= 0 and rc.group_size >= 0,
         "rollout.num_env_groups and rollout.group_size must be >= 0"),
        (cfg.weights.backend in ("auto", "gloo", "nccl"), "weights.backend must be 'auto', 'gloo' or 'nccl'"),
        (cfg.weights.bucket_mb >= 1 and cfg.weights.timeout_s > 0,
         "weights.bucket_mb must be >= 1 and weights.timeout_s > 0"),
        (ic.drain_timeout_s >= 0, "inference.drain_timeout_s must be >= 0"),
        (rc.drain_timeout_s >= 0, "rollout.drain_timeout_s must be >= 0"),
        (cfg.env.drain_timeout_s >= 0, "env.drain_timeout_s must be >= 0"),
        (not ic.autoscale.enabled or (ic.servers_per_process == 1 and cfg.weights.transport == "disk"),
         "inference.autoscale needs inference.servers_per_process=1 and weights.transport=disk (it starts servers "
         "mid-run; on Ray, wherever Ray places them or its autoscaler adds a node)"),
    ]
    from arl.weights.strategy import weights_problems

    checks += [(False, p) for p in weights_problems(weights_settings(cfg), _weights_facts(cfg))]
    checks.append((ic.backend in INFERENCE_BACKENDS, f"inference.backend: {INFERENCE_BACKENDS.unknown(ic.backend)}"))
    checks.append((lc.backend in LEARNER_BACKENDS, f"learner.backend: {LEARNER_BACKENDS.unknown(lc.backend)}"))
    checks += [(name == "jsonl" or name in TRACKERS, f"loggers: {TRACKERS.unknown(name)}") for name in cfg.loggers]
    checks += [(False, p) for p in lora_problems(cfg)]
    checks += [(False, p) for p in policy_problems(cfg)]
    checks += [(False, p) for p in judge_problems(cfg)]
    checks += [(False, p) for p in timeout_problems(cfg)]
    checks += [(False, p) for p in staleness_auto_problems(cfg)]
    _require(checks)
    if rc.num_env_groups > 0:  # env groups: partition and per-worker capacity, before any process starts
        try:
            partition_groups(rc.num_env_groups, list(rc.tags) or [cfg.env.name], list(rc.num_groups_partition))
            check_env_capacity(rc.num_env_groups, rc.num_workers, rc.group_size or cfg.agent.group_size,
                               rc.max_env_num_per_worker)
            if rc.num_env_groups < rc.num_workers:
                raise ValueError(f"num_env_groups={rc.num_env_groups} < rollout.num_workers={rc.num_workers}")
        except ValueError as e:
            raise ConfigError(f"rollout env groups: {e}") from None


def judge_workers(cfg: ExperimentConfig) -> int:
    """Judge worker processes of the run: judge.inference.num_workers when a judge model is set, else none."""
    return cfg.judge.inference.num_workers if cfg.judge.model.path else 0


def judge_problems(cfg: ExperimentConfig) -> list[str]:
    """Why the judge section cannot run (start-up refusals), [] when fine or unused."""
    jc, uses = cfg.judge, cfg.env.name == "judge" or any(
        isinstance(s, dict) and s.get("name") == "judge" for s in dict(cfg.rollout.env_configs).values())
    if not jc.model.path:
        return ["env.name=judge needs judge.model.path (the judge model's folder)"] if uses else []
    out = []
    if not os.path.isdir(os.path.expanduser(jc.model.path)):
        out.append(f"judge.model.path {jc.model.path!r} is not a folder")
    if jc.inference.num_workers < 1 or jc.inference.servers_per_process != 1:
        out.append("judge.inference.num_workers must be >= 1 and judge.inference.servers_per_process 1")
    if jc.inference.backend not in ("torch", "sglang"):
        out.append(f"judge.inference.backend must be 'torch' or 'sglang', got {jc.inference.backend!r}")
    if jc.mode == JudgeMode.classifier and jc.inference.backend != "torch":
        out.append("judge.mode=classifier needs judge.inference.backend=torch (SGLang serves generative judges)")
    if cfg.env.servers and uses:
        out.append("env.name=judge runs in the rollout workers: set env.servers=0")
    try:
        re.compile(jc.score_regex)
    except Exception as e:  # noqa: BLE001 - a bad pattern is refused with its error
        out.append(f"judge.score_regex {jc.score_regex!r}: {e}")
    for name, text in (("template", jc.template), ("classifier_template", jc.classifier_template)):
        try:
            text.format(question="", answer="", reference="")
        except (KeyError, IndexError, ValueError) as e:
            out.append(f"judge.{name}: only {{question}}, {{answer}} and {{reference}} may be filled in ({e!r})")
    if "{answer}" not in (jc.template if jc.mode == JudgeMode.generative else jc.classifier_template):
        out.append(f"judge: the {jc.mode} template must contain {{answer}}")
    if not (jc.score_max > jc.score_min and jc.timeout > 0 and jc.max_new_tokens >= 1):
        out.append("judge: score_max must be > score_min, timeout > 0 and max_new_tokens >= 1")
    return out


# inference backends that apply adapter payloads (`arl.weights.adapter`): torch merges them, SGLang loads them as
# LoRA adapters, sim loads nothing
LORA_INFERENCE_BACKENDS = ("torch", "sglang", "sim")
POLICY_INFERENCE_BACKENDS = ("torch", "sglang")  # serve named LoRA policies beside the run's own


def lora_problems(cfg: ExperimentConfig) -> list[str]:
    """Why ``learner.lora`` cannot run here: a learner or inference backend that cannot train or serve adapters, a
    target module the model (when its folder exists already) does not have."""
    lora = cfg.learner.lora
    if not lora.enabled:
        return []
    out = []
    if cfg.learner.backend == "sim":
        out.append("learner.lora.rank > 0 needs a learner that trains a model (learner.backend=sim trains none)")
    if cfg.inference.backend not in LORA_INFERENCE_BACKENDS:
        out.append(f"learner.lora.rank > 0: inference.backend={cfg.inference.backend} cannot serve LoRA adapters "
                   f"(these can: {', '.join(LORA_INFERENCE_BACKENDS)})")
    from arl.weights.strategy import TRANSPORTS

    if cfg.inference.backend == "sglang" and cfg.weights.transport in TRANSPORTS:  # an unknown name: weights_problems
        folders = [n for n in TRANSPORTS.names() if TRANSPORTS.get(n).carries_folders]
        if cfg.weights.transport not in folders:
            out.append(f"learner.lora.rank > 0 with inference.backend=sglang needs a weights.transport that carries "
                       f"each version as a folder (SGLang loads each version's adapter from one, /load_lora_adapter); "
                       f"weights.transport={cfg.weights.transport} does not; these do: {', '.join(folders)}")
    if cfg.inference.backend == "sglang" and lora.modules_to_save:
        out.append("learner.lora.modules_to_save with inference.backend=sglang: SGLang's adapters cannot carry "
                   "fully trained modules")
    if cfg.model.path and os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        from arl.weights.adapter import target_problems

        out += target_problems(_module_names(cfg.model.path), list(lora.target_modules), list(lora.modules_to_save))
    return out


def policy_problems(cfg: ExperimentConfig) -> list[str]:
    """Why the listed `policies` cannot be served: a name twice, the run's own name or a bad one, a trainable
    policy (not built), an adapter folder that is missing or not a peft LoRA folder, or a run that would move the
    base under them (full fine-tuning) or cannot serve them beside its own adapter."""
    from arl.api.types import POLICY_NAME

    if not cfg.policies:
        return []
    out = []
    names = [p.name for p in cfg.policies]
    for name in sorted({n for n in names if names.count(n) > 1}):
        out.append(f"policies: two policies are named {name!r}")
    for p in cfg.policies:
        where = f"policies[{p.name!r}]"
        if not POLICY_NAME.fullmatch(p.name or ""):
            out.append(f"{where}: a policy's name is a letter or digit, then letters, digits, '_', '.' and '-', at "
                       f"most 64 in all (it names an adapter and its folder)")
        elif p.name == OWN_POLICY:
            out.append(f"{where}: {OWN_POLICY!r} is the run's own policy's name")
        bad = [i for i in p.servers if not 0 <= i < cfg.inference.num_workers]
        if bad or len(set(p.servers)) != len(p.servers):
            out.append(f"{where}: servers {list(p.servers)}: each an inference server's index, once, below "
                       f"inference.num_workers={cfg.inference.num_workers}")
        if p.learner and not p.trainable:
            out.append(f"{where}: a frozen policy (trainable=false) has no learner, so its learner section "
                       f"{sorted(p.learner)} would be ignored")
        if p.trainable:
            out += _trainable_problems(cfg, p, where)
        try:
            policy_lora_config(cfg, p)
        except ValueError as e:
            if not (p.trainable and _learner_error(cfg, p)):  # a bad learner key is said once, below
                out.append(f"{where}: adapter {e}")
    lora = cfg.learner.lora
    if not lora.enabled:
        out.append("policies: frozen policies are LoRA deltas on the run's base model, which full fine-tuning would "
                   "move under them: train the run's own policy with LoRA too (learner.lora.rank > 0)")
    elif lora.modules_to_save:
        out.append("policies: the run's adapter is served beside them from an adapter slot, which cannot hold the "
                   "whole tensors of learner.lora.modules_to_save")
    if cfg.inference.backend not in POLICY_INFERENCE_BACKENDS:
        out.append(f"policies: inference.backend={cfg.inference.backend} cannot serve named LoRA policies (these "
                   f"can: {', '.join(POLICY_INFERENCE_BACKENDS)})")
    return out


def _trainable_problems(cfg: ExperimentConfig, p: PolicyConfig, where: str) -> list[str]:
    """Why trainable policy `p` cannot be trained in this run (what its own learner does not do yet is named)."""
    out = []
    if p.adapter != BASE_ADAPTER:
        out.append(f"{where}: a trainable policy starts from a fresh adapter on the run's base (adapter: "
                   f"{BASE_ADAPTER}); starting it from a folder is not built")
    error = _learner_error(cfg, p)
    if error:
        return out + [f"{where}: learner: {error}"[:300]]
    fixed = {"weights.transport": (str(cfg.weights.transport), "disk"), "launcher": (_name(cfg.launcher), "local"),
             "recover": (_name(cfg.recover), "off"), "learner.num_ranks": (cfg.learner.num_ranks, 1)}
    for key, (have, need) in fixed.items():
        if have != need:
            out.append(f"{where}: a trainable policy's learner needs {key}={need} (this run: {have}); the others "
                       f"are not built for it yet")
    return out


def _learner_error(cfg: ExperimentConfig, p: PolicyConfig) -> str:
    """Why trainable policy `p`'s learner section does not fit the run's (a key it lacks, a wrong type), or ''."""
    try:
        policy_learner_config(cfg, p)
    except ValueError as e:
        return str(e)
    return ""


def _name(v: Any) -> str:
    return str(getattr(v, "name", v))


def trainable_policies(cfg: ExperimentConfig) -> list[PolicyConfig]:
    """The listed policies the run trains, in order: policy k-1 is learner role index k (index 0: the run's own)."""
    return [p for p in cfg.policies if p.trainable]


def policy_learner_config(cfg: ExperimentConfig, p: PolicyConfig) -> LearnerConfig:
    """The learner section of trainable policy `p`: the run's, with the keys `p.learner` sets (typed, checked)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cfg.learner), OmegaConf.create(dict(p.learner)))
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:  # a typo or a wrong type: named, as any other bad key
        raise ValueError(f"{type(e).__name__}: {str(e).splitlines()[0]}") from None


def policy_placement(cfg: ExperimentConfig) -> dict[str, list[int]]:
    """Listed policy -> the servers that serve it, for the policies placed on some (`servers`) and the trainable
    ones (their versions go to the run's configured servers: a server added mid-run, `arl.ctl scale`, does not
    serve them); the others are on every server."""
    every = list(range(cfg.inference.num_workers))
    return {p.name: list(p.servers) or every for p in cfg.policies if p.servers or p.trainable}


def policy_lora_config(cfg: ExperimentConfig, p: PolicyConfig) -> dict[str, Any]:
    """The peft config of a listed policy's adapter (`arl.weights.adapter.read_lora_config`; ValueError saying why
    the folder is not one); `adapter: base` is a rank-1 zero delta on the modules the run's own adapter has
    (`arl.weights.adapter.base_payload`)."""
    from arl.weights.adapter import read_lora_config

    if p.trainable:  # what its learner trains and publishes
        lora = policy_learner_config(cfg, p).lora if p.learner else cfg.learner.lora
        if not lora.enabled or lora.modules_to_save:
            raise ValueError("of a trainable policy is a LoRA adapter without modules_to_save (its learner's "
                             f"learner.lora: rank {lora.rank}, modules_to_save {list(lora.modules_to_save)})")
        return {"r": int(lora.rank), "target_modules": list(lora.target_modules)}
    if p.adapter == BASE_ADAPTER:
        return {"r": 1, "target_modules": list(cfg.learner.lora.target_modules)}
    return read_lora_config(p.adapter)


def policy_adapters(cfg: ExperimentConfig) -> tuple[int, list[str]]:
    """The largest LoRA rank among the listed policies' adapters and the modules any of them adapts (what an
    inference server must make room for; 0 and [] when none is listed or readable)."""
    rank, targets = 0, set()
    for p in cfg.policies:
        try:
            peft = policy_lora_config(cfg, p)
        except ValueError:  # refused by `policy_problems`
            continue
        rank = max(rank, peft["r"])
        found = peft.get("target_modules") or []
        targets.update([found] if isinstance(found, str) else found)
    return rank, sorted(targets)


def _module_names(model_dir: str) -> list[str]:
    """``named_modules()`` names of the model of `model_dir`, built on the meta device (no weights read)."""
    from arl.weights.adapter import meta_model

    return [n for n, _ in meta_model(model_dir).named_modules()]


AUTO_REQUEST_BASE_S = 60.0  # the auto request deadline's fixed part (queueing, prefill)


def rollout_deadlines(cfg: ExperimentConfig) -> tuple[float, float, float]:
    """(request base seconds, request seconds per new token, trajectory seconds) for the rollout workers' inference
    client and agents: the configured values, or with 0 (auto) derived from the generation budget, so long answers
    are not dropped as timeouts more often than short ones (which would push the policy toward short answers)."""
    rc = cfg.rollout
    if rc.request_timeout > 0:
        base, per_token = float(rc.request_timeout), 0.0
    else:
        base, per_token = AUTO_REQUEST_BASE_S, float(rc.timeout_per_token_s)
    if rc.trajectory_timeout > 0:
        return base, per_token, float(rc.trajectory_timeout)
    request = base + per_token * cfg.gen.max_new_tokens
    return base, per_token, agent_turns(cfg) * (2 * request + 2 * float(rc.env_timeout))


def timeout_problems(cfg: ExperimentConfig) -> list[str]:
    """Env-server timeouts that contradict the rollout workers' deadlines (start-up refusals naming both keys)."""
    if cfg.env.servers <= 0 or cfg.rollout.env_timeout <= 0 or cfg.env.session_lease_s <= 0:
        return []  # no env servers: neither is used (bad signs are refused by validate's own checks)
    rc, ec, out = cfg.rollout, cfg.env, []
    base, per_token, _ = rollout_deadlines(cfg)
    request = base + per_token * cfg.gen.max_new_tokens
    if ec.session_lease_s <= 2 * request:  # a turn's generation: two attempts, as the auto trajectory deadline counts
        how = (f"rollout.request_timeout={rc.request_timeout:g}" if rc.request_timeout > 0 else
               f"{AUTO_REQUEST_BASE_S:g} s + rollout.timeout_per_token_s={rc.timeout_per_token_s:g} x "
               f"gen.max_new_tokens={cfg.gen.max_new_tokens}")
        out.append(f"env.session_lease_s={ec.session_lease_s:g} must exceed the longest wait of one turn's generation, "
                   f"2 attempts x the request deadline ({how}) = {2 * request:.0f} s: an env session idle that long is "
                   f"closed under a slow turn; raise env.session_lease_s or lower the request deadline")
    if ec.call_timeout > 0 and ec.call_timeout >= rc.env_timeout:
        out.append(f"env.call_timeout={ec.call_timeout:g} must be < rollout.env_timeout={rc.env_timeout:g}: the env "
                   f"server must give up on a call before the rollout worker does (0: 0.9 x rollout.env_timeout)")
    return out


def agent_turns(cfg: ExperimentConfig) -> int:
    """Turns the configured agent may take: its `max_turns` / `num_turns` as it will run, i.e. `agent.args` over
    the defaults of its registered constructor (the default math agent: 3); 1 if it has neither."""
    settings: dict[str, Any] = {}
    if cfg.agent.name in AGENTS:
        try:
            params = inspect.signature(AGENTS.get(cfg.agent.name)).parameters.values()
            settings = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        except (TypeError, ValueError):  # a callable without a signature: its args alone
            pass
    settings.update(cfg.agent.args)
    try:
        return max(1, int(settings.get("max_turns") or settings.get("num_turns") or 1))
    except (TypeError, ValueError):
        return 1


def import_user_modules(modules: Sequence[str]) -> None:
    """Import the modules named in `imports=[...]` (their register_* calls run in this process)."""
    import sys

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 - report any import failure as a config problem
            raise ConfigError(f"imports: could not import module {m!r}: {type(e).__name__}: {e}") from None


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def auto_eta(cfg: ExperimentConfig) -> bool:
    """`max_head_offpolicyness=auto`: the controller steers the admitted eta."""
    return cfg.max_head_offpolicyness == "auto"


def eta_bound(cfg: ExperimentConfig) -> int:
    """The run's hard staleness bound: `max_head_offpolicyness`, or with 'auto' `staleness_auto.eta_max` (what the
    learner drops by; admission steers below it). ConfigError for anything but an int >= 0 or 'auto'."""
    eta = cfg.max_head_offpolicyness
    if eta == "auto":
        return int(cfg.staleness_auto.eta_max)
    if isinstance(eta, str) and eta.strip().isdigit():
        return int(eta)
    if isinstance(eta, bool) or not isinstance(eta, int) or eta < 0:
        raise ConfigError(f"max_head_offpolicyness must be an int >= 0 or 'auto', got {eta!r}")
    return eta


def staleness_auto_problems(cfg: ExperimentConfig) -> list[str]:
    sa = cfg.staleness_auto
    if not auto_eta(cfg):
        return []
    out = []
    if not 1 <= sa.eta_min <= sa.eta_start <= sa.eta_max:
        out.append(f"staleness_auto needs 1 <= eta_min <= eta_start <= eta_max, got {sa.eta_min} / {sa.eta_start} / "
                   f"{sa.eta_max}")
    if min(sa.raise_after, sa.window, sa.smooth) < 1:
        out.append("staleness_auto.raise_after, staleness_auto.window and staleness_auto.smooth must be >= 1")
    if min(sa.mismatch_kl_max, sa.clip_frac_max, sa.capped_frac_max) <= 0 or sa.grad_norm_spike < 0:
        out.append("staleness_auto thresholds must be > 0 (grad_norm_spike >= 0, 0: off)")
    return out


def staleness_policy(cfg: ExperimentConfig) -> StalenessPolicy:
    """The run's staleness rule: the controller's admission, the learner's group drop and the actor's token mask
    all take this one object (built once per process, here). With 'auto' its eta is the bound; the controller's
    gate admits at the eta it steers to."""
    ppo = cfg.learner.ppo
    return StalenessPolicy(eta=eta_bound(cfg), stale_tokens=str(ppo.stale_tokens), decay=ppo.stale_token_decay)


def weights_backend(cfg: ExperimentConfig) -> str:
    """The broadcast group backend: `weights.backend`, or with 'auto' nccl when inference runs on CUDA (a run
    whose learner and inference share a GPU gets disk instead: `resolve_weights`)."""
    if cfg.weights.backend != "auto":
        return cfg.weights.backend
    return "nccl" if cfg.inference.device.startswith("cuda") else "gloo"


def _cuda_index(device: str) -> int:
    """The GPU index of a torch device string ('cuda' -> 0, 'cuda:2' -> 2)."""
    _, _, idx = device.partition(":")
    try:
        return int(idx) if idx else 0
    except ValueError:
        return 0


def shared_gpu(cfg: ExperimentConfig) -> Optional[str]:
    """Why learner rank 0 (the weight sender) and an inference server would run on the same GPU, or None (they
    would not, or inference is not on CUDA). Locally, learner rank 0 trains on GPU 0 of CUDA_VISIBLE_DEVICES
    (LOCAL_RANK 0); under Ray only whole GPUs per bundle keep them apart."""
    ic = cfg.inference
    if not ic.device.startswith("cuda") or cfg.learner.device == LearnerDevice.cpu or cfg.learner.backend == "sim":
        return None
    if cfg.launcher == LauncherKind.ray:
        r = cfg.ray
        if r.gpus_per_learner_rank >= 1 and r.gpus_per_inference >= 1:
            return None
        return (f"under Ray, learner rank 0 and an inference server may share a GPU unless each gets whole GPUs "
                f"(ray.gpus_per_learner_rank={r.gpus_per_learner_rank:g}, ray.gpus_per_inference="
                f"{r.gpus_per_inference:g})")
    if ic.backend == "sglang":
        sg = ic.sglang
        if sg.gpus_per_server > 0 and sg.first_gpu > 0:
            return None
        return (f"SGLang server 0 runs on GPU 0 (inference.sglang.first_gpu={sg.first_gpu}, gpus_per_server="
                f"{sg.gpus_per_server}), where learner rank 0 trains; set inference.sglang.first_gpu >= "
                f"learner.num_ranks")
    if _cuda_index(ic.device) == 0:
        return (f"inference.device={ic.device} is GPU 0, where learner rank 0 trains; put inference on another "
                f"GPU (inference.device=cuda:{max(1, cfg.learner.num_ranks)})")
    return None


def weights_settings(cfg: ExperimentConfig) -> WeightsSettings:
    """The `arl.weights.strategy.WeightsSettings` of a run: the transport's name and knobs, resolved."""
    from arl.weights.strategy import WeightsSettings

    w = cfg.weights
    return WeightsSettings(transport=str(w.transport), backend=weights_backend(cfg), bucket_bytes=w.bucket_mb << 20,
                           timeout_s=w.timeout_s, receivers="sglang" if cfg.inference.backend == "sglang" else "arl")


def _weights_facts(cfg: ExperimentConfig) -> RunFacts:
    """What the transport's checks may ask of the run (`arl.weights.strategy.RunFacts`)."""
    from arl.weights.strategy import RunFacts

    return RunFacts(inference_backend=cfg.inference.backend, learner_trains=cfg.learner.backend != "sim",
                    servers_per_process=cfg.inference.servers_per_process, backend_setting=cfg.weights.backend,
                    shared_gpu=shared_gpu(cfg))


def resolve_weights(cfg: ExperimentConfig) -> tuple[ExperimentConfig, Optional[str]]:
    """The config a run uses for weights, and a note when it differs: the transport may hand over to another
    (broadcast with `weights.backend=auto` goes by disk between a learner and inference that share a GPU, which
    NCCL cannot: `shared_gpu`)."""
    from arl.weights.strategy import make_transport

    other = make_transport(weights_settings(cfg)).fallback(_weights_facts(cfg))
    if other is None:
        return cfg, None
    name, note = other
    return dataclasses.replace(cfg, weights=dataclasses.replace(cfg.weights, transport=name)), note


def resolve_threads(cfg: ExperimentConfig, role: str) -> int:
    """torch threads for a role: its own setting, or the cores split between the compute-heavy roles."""
    if role == "judge":
        return cfg.judge.inference.threads or 1  # a judge worker scores a few texts per env step
    explicit = {"inference": cfg.inference.threads, "learner": cfg.learner.threads}.get(role, 1)
    return explicit or max(1, (os.cpu_count() or 1) // (cfg.inference.num_workers + 1))  # inference workers + learner


__all__ = [
    "ExperimentConfig", "ConfigError", "parse_overrides", "split_experiment", "format_help", "import_user_modules",
    "to_yaml", "resolve_threads", "weights_backend", "weights_settings", "shared_gpu", "resolve_weights",
    "rollout_deadlines", "timeout_problems", "agent_turns", "judge_workers", "judge_problems", "DictConfig",
    "partition_groups", "worker_groups", "check_env_capacity", "PolicyConfig", "policy_problems", "policy_adapters",
    "trainable_policies", "policy_learner_config", "policy_placement",
    "OWN_POLICY",
]
