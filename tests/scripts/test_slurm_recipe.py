"""scripts/slurm/ray_cluster.sbatch cannot meet a real Slurm here: it runs under bash with fake `scontrol`, `srun`,
`hostname`, `ray` and `python` first on PATH. Each fake appends its argv to a log; the fake `ray` keeps a tiny
cluster state in files (head up, workers joined, stopped) so that the script's wait loops see what a real
`ray status` would show."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm" / "ray_cluster.sbatch"

NODES = ["gpu01", "gpu02", "gpu03"]
HEAD_IP = "10.0.0.1"
PORT = "6390"

# One log line per call: "<name>@<node srun put it on>\t<arg>\t<arg>...". A single printf per line keeps lines
# whole when the background steps and the script write at the same time (O_APPEND).
_LOG = r'''
log() { local line; line=$(printf '%s\t' "$@"); printf '%s\n' "$line" >>"$FAKE_LOG"; }
'''

FAKES = {
    "scontrol": _LOG + r'''
log "scontrol@" "$@"
[[ $1 == show && $2 == hostnames ]] || exit 2
printf '%s\n' $FAKE_NODES
''',
    # Strips srun's options (only -w takes a separate value in the script) and runs the command "on" that node.
    "srun": _LOG + r'''
log "srun@" "$@"
node=
while (($#)) && [[ $1 == -* ]]; do
    if [[ $1 == -w ]]; then node=$2; shift 2; else shift; fi
done
export FAKE_SRUN_NODE=$node
exec "$@"
''',
    "hostname": _LOG + r'''
log "hostname@${FAKE_SRUN_NODE:-}" "$@"
echo "$FAKE_HOST_IPS"
''',
    "ray": _LOG + r'''
log "ray@${FAKE_SRUN_NODE:-}" "$@"
log "ray-auth@${FAKE_SRUN_NODE:-}" "$1" "${RAY_AUTH_MODE:-}" "${RAY_AUTH_TOKEN:-}"
cmd=$1
case $cmd in
start)
    head=0
    for a in "$@"; do [[ $a == --head ]] && head=1; done
    if ((head)); then
        [[ -n ${FAKE_HEAD_EXIT:-} ]] && exit "$FAKE_HEAD_EXIT"
        [[ -n ${FAKE_HEAD_SILENT:-} ]] || touch "$FAKE_DIR/head_up"
    elif [[ -z ${FAKE_WORKERS_SILENT:-} ]]; then
        mktemp "$FAKE_DIR/worker.XXXXXX" >/dev/null
    fi
    # --block: stay until `ray stop` (or a signal), like the real one.
    while [[ ! -e $FAKE_DIR/stopped ]]; do sleep 0.05; done
    ;;
status)
    # A head that is slow to answer: the real `ray status` keeps retrying an absent GCS for about 45 s.
    if [[ -n ${FAKE_STATUS_STALL:-} ]]; then
        sleep "$FAKE_STATUS_STALL" </dev/null >/dev/null 2>&1
        touch "$FAKE_DIR/head_up"
    fi
    if [[ ! -e $FAKE_DIR/head_up ]]; then
        echo "ConnectionError: Could not find any running Ray instance." >&2
        exit 1
    fi
    workers=$(find "$FAKE_DIR" -name 'worker.*' | wc -l)
    # The format of Ray 2.x with autoscaler v2: a busy head under Active, idle workers listed apart.
    echo "======== Autoscaler status: 2025-01-01 00:00:00 ========"
    echo "Node status"
    echo "--------------------------------------------------------"
    echo "Active:"
    echo " 1 node_5e1b0c9f"
    echo "Idle:"
    if ((workers == 0)); then echo " (no idle nodes)"; fi
    for ((i = 1; i <= workers; i++)); do echo " 1 node_a7c3d${i}"; done
    echo "Pending:"
    echo " (no pending nodes)"
    echo "Recent failures:"
    echo " (no failures)"
    echo
    echo "Resources"
    echo "--------------------------------------------------------"
    echo "Total Usage:"
    echo " 0.0/24.0 CPU"
    for ((i = 0; i <= workers; i++)); do echo " 0.0/1.0 node_$i"; done
    ;;
stop)
    touch "$FAKE_DIR/stopped"
    ;;
esac
''',
    # Records its argv, where it ran and how many Ray nodes were up at that moment, and exits with FAKE_PY_RC.
    "python": _LOG + r'''
log "python@" "$@"
workers=$(find "$FAKE_DIR" -name 'worker.*' | wc -l)
up=0; [[ -e $FAKE_DIR/head_up && ! -e $FAKE_DIR/stopped ]] && up=$((1 + workers))
log "python-env@" "$PWD" "${RAY_ADDRESS:-}" "$up"
log "python-auth@" "${RAY_AUTH_MODE:-}" "${RAY_AUTH_TOKEN:-}"
exit "${FAKE_PY_RC:-0}"
''',
}


def run_recipe(tmp_path: Path, args: list[str], timeout_s: str = "30", **fake_env: str
               ) -> tuple[subprocess.CompletedProcess, list[tuple[str, str, list[str]]], Path]:
    """Run the sbatch script as Slurm would (bash, SLURM_* set) with the fakes; returns the process, the log as
    (program, node, argv) tuples in call order, and the submit directory."""
    bin_dir, state, submit = tmp_path / "bin", tmp_path / "state", tmp_path / "submit"
    for d in (bin_dir, state, submit):
        d.mkdir()
    for name, body in FAKES.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)
    log = tmp_path / "calls.log"
    log.touch()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RAY_", "ARL_", "FAKE_")) and k != "PYTHON"}
    env.update({
        "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
        "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_JOB_NUM_NODES": "3",
        "SLURM_SUBMIT_DIR": str(submit), "SLURM_CPUS_PER_TASK": "8", "SLURM_GPUS_ON_NODE": "4",
        "RAY_PORT": PORT, "ARL_WAIT_TIMEOUT": timeout_s, "ARL_POLL_INTERVAL": "0.05",
        "ARL_ARGS": "seed=3  total_train_steps=5",
        "FAKE_LOG": str(log), "FAKE_DIR": str(state), "FAKE_NODES": " ".join(NODES),
        # IPv6 first, then the loopback alias Debian puts in /etc/hosts: the script must skip both.
        "FAKE_HOST_IPS": f"fe80::1 127.0.1.1 {HEAD_IP} 192.168.5.1",
        **fake_env,
    })
    proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    calls = []
    for line in log.read_text().splitlines():
        who, *argv = line.rstrip("\t").split("\t")
        prog, _, node = who.partition("@")
        calls.append((prog, node, argv))
    return proc, calls, submit


def ray_starts(calls: list[tuple[str, str, list[str]]]) -> list[tuple[int, str, list[str]]]:
    return [(i, node, argv) for i, (prog, node, argv) in enumerate(calls) if prog == "ray" and argv[0] == "start"]


def index_of(calls: list[tuple[str, str, list[str]]], prog: str, first: Optional[str] = None) -> list[int]:
    return [i for i, (p, _, argv) in enumerate(calls) if p == prog and (first is None or argv[:1] == [first])]


def test_bash_parses_the_script() -> None:
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_sbatch_directives_come_before_the_first_command() -> None:
    # sbatch stops reading #SBATCH lines at the first line that is neither a comment nor blank.
    lines = SCRIPT.read_text().splitlines()
    assert lines[0].startswith("#!")
    first_command = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.lstrip().startswith("#"))
    directives = [i for i, ln in enumerate(lines) if ln.startswith("#SBATCH")]
    assert directives and max(directives) < first_command
    assert "#SBATCH --ntasks-per-node=1" in lines


def test_starts_head_and_workers_runs_entry_point_and_stops_ray(tmp_path: Path) -> None:
    passthrough = ["weights.transport=broadcast", "ray.placement.inference={node_0: 0.01}"]
    proc, calls, submit = run_recipe(tmp_path, passthrough)
    assert proc.returncode == 0, proc.stderr

    assert [argv for prog, _, argv in calls if prog == "scontrol"] == [["show", "hostnames", "gpu[01-03]"]]
    assert [node for prog, node, _ in calls if prog == "hostname"] == ["gpu01"]  # the head's address, asked there

    starts = ray_starts(calls)
    heads = [s for s in starts if "--head" in s[2]]
    assert len(heads) == 1
    _, head_node, head_argv = heads[0]
    assert head_node == "gpu01"
    for flag in (f"--node-ip-address={HEAD_IP}", f"--port={PORT}", '--resources={"node_0": 1}', "--num-cpus=8",
                 "--num-gpus=4", "--block"):
        assert flag in head_argv

    workers = sorted((s for s in starts if "--head" not in s[2]), key=lambda s: s[1])  # they start in parallel
    assert [node for _, node, _ in workers] == ["gpu02", "gpu03"]
    for index, (_, node, argv) in enumerate(workers, start=1):
        assert f"--address={HEAD_IP}:{PORT}" in argv
        assert f'--resources={{"node_{index}": 1}}' in argv
        assert "--num-cpus=8" in argv and "--num-gpus=4" in argv and "--block" in argv
    assert heads[0][0] < min(i for i, _, _ in workers)
    # Every poll asks the head's address, not whatever cluster this machine might belong to.
    polls = [argv for prog, _, argv in calls if prog == "ray" and argv[0] == "status"]
    assert polls and all(argv == ["status", f"--address={HEAD_IP}:{PORT}"] for argv in polls)

    pythons = [argv for prog, _, argv in calls if prog == "python"]
    assert pythons == [["training/main_async_ppo.py", "launcher=ray", "ray.address=auto", "seed=3",
                        "total_train_steps=5", *passthrough]]
    (cwd, ray_address, nodes_up), = [argv for prog, _, argv in calls if prog == "python-env"]
    assert cwd == str(submit) and ray_address == f"{HEAD_IP}:{PORT}"
    assert nodes_up == "3"  # the driver started only once every node had joined, and before Ray was stopped

    stops = index_of(calls, "ray", "stop")
    assert stops and min(stops) > index_of(calls, "python")[0]
    stop_srun = [argv for prog, _, argv in calls if prog == "srun" and "stop" in argv]
    assert len(stop_srun) == 1 and "--overlap" in stop_srun[0] and "--nodes=3" in stop_srun[0]


def test_exit_code_is_the_entry_points(tmp_path: Path) -> None:
    proc, calls, _ = run_recipe(tmp_path, [], FAKE_PY_RC="7")
    assert proc.returncode == 7, proc.stderr
    assert len(index_of(calls, "python")) == 1
    assert index_of(calls, "ray", "stop")  # Ray is stopped on a failed run too


def test_head_that_never_answers_times_out(tmp_path: Path) -> None:
    proc, calls, _ = run_recipe(tmp_path, [], timeout_s="1", FAKE_HEAD_SILENT="1")
    assert proc.returncode != 0
    assert f"Ray head at {HEAD_IP}:{PORT} did not answer within 1s" in proc.stderr
    assert len(ray_starts(calls)) == 1  # no worker was started against a head that is not there
    assert not index_of(calls, "python")
    assert index_of(calls, "ray", "stop")


def test_a_poll_that_hangs_is_cut_at_the_timeout(tmp_path: Path) -> None:
    # The head would answer after 20 s, long after the 1 s timeout: the script must not wait for that answer.
    proc, calls, _ = run_recipe(tmp_path, [], timeout_s="1", FAKE_HEAD_SILENT="1", FAKE_STATUS_STALL="20")
    assert proc.returncode != 0
    assert f"Ray head at {HEAD_IP}:{PORT} did not answer within 1s" in proc.stderr, proc.stderr
    assert len(ray_starts(calls)) == 1


def test_head_that_exits_fails_without_waiting_out_the_timeout(tmp_path: Path) -> None:
    proc, calls, _ = run_recipe(tmp_path, [], timeout_s="60", FAKE_HEAD_EXIT="3")
    assert proc.returncode != 0
    assert "ray start on gpu01 exited early" in proc.stderr
    assert "did not answer" not in proc.stderr
    assert not index_of(calls, "python")


def test_workers_that_never_join_time_out(tmp_path: Path) -> None:
    proc, calls, _ = run_recipe(tmp_path, [], timeout_s="1", FAKE_WORKERS_SILENT="1")
    assert proc.returncode != 0
    assert re.search(r"1 of 3 nodes joined the Ray cluster at 10\.0\.0\.1:6390 within 1s", proc.stderr), proc.stderr
    assert len(ray_starts(calls)) == 3
    assert not index_of(calls, "python")
    assert index_of(calls, "ray", "stop")


def auth_seen(calls: list[tuple[str, str, list[str]]]) -> list[tuple[str, str, list[str]]]:
    """(program, node, [mode, token]) of every `ray` command and the driver, as each saw its environment."""
    return [(prog, node, ((argv[1:] if prog == "ray-auth" else argv) + ["", ""])[:2])  # an empty last field is cut
            for prog, node, argv in calls if prog in ("ray-auth", "python-auth")]


def test_every_node_and_the_driver_share_one_ray_auth_token(tmp_path: Path) -> None:
    """Ray's token authentication: a node or driver without the head's token is refused, so the recipe gives every
    `ray start`, `ray status` and the driver RAY_AUTH_MODE=token and the same token, a fresh one per job."""
    proc, calls, _ = run_recipe(tmp_path, [])
    assert proc.returncode == 0, proc.stderr
    seen = auth_seen(calls)
    nodes = {node for prog, node, _ in seen if prog == "ray-auth"}
    assert nodes >= set(NODES) and any(prog == "python-auth" for prog, _, _ in seen), seen
    tokens = {tuple(auth) for _, _, auth in seen}
    assert len(tokens) == 1, tokens
    ((mode, token),) = tokens
    assert mode == "token" and re.fullmatch(r"[0-9a-f]{64}", token), tokens
    # it travels in the environment: no command line (visible to every user of a node) carries it
    assert not [argv for prog, _, argv in calls if prog not in ("ray-auth", "python-auth") and token in "".join(argv)]
    (tmp_path / "again").mkdir()
    again = auth_seen(run_recipe(tmp_path / "again", [])[1])
    assert {tuple(a) for _, _, a in again} != tokens  # a new token for each job


def test_a_given_ray_auth_token_or_mode_is_kept(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    token_file = tmp_path / "token"
    token_file.write_text("f" * 64)
    proc, calls, _ = run_recipe(tmp_path / "a", [], RAY_AUTH_TOKEN_PATH=str(token_file))
    assert proc.returncode == 0, proc.stderr
    assert {tuple(a) for _, _, a in auth_seen(calls)} == {("token", "f" * 64)}
    (tmp_path / "b").mkdir()
    proc, calls, _ = run_recipe(tmp_path / "b", [], RAY_AUTH_MODE="disabled")
    assert proc.returncode == 0, proc.stderr
    assert {tuple(a) for _, _, a in auth_seen(calls)} == {("disabled", "")}
