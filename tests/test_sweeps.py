"""Sweeps: experiment configs, job identity, the seed rule, launchers, and a resumable
sweep through ``submitit_local`` that is killed part-way and rerun.

The sweep test runs 2 methods × 2 budgets × 2 seeds of a tiny random Llama (saved to a tmp dir
with SmolLM2's tokenizer): h2o (nothing random: seed 1 is skipped without a result) and kqsvd
(calibrated: both seeds run). It kills the whole sweep (SIGKILL to its process group) as soon as
the first result appears, reruns the same command, and checks that every job finished exactly
once: results finished before the kill are byte-identical afterwards (a job run again rewrites
its timings), each job's log shows one "running" line per execution and a "skipping" line for
the rerun of a finished job, and every result parses with the right job_id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvbench.store.identity import EXCLUDED_KEYS, identity_config, is_done, job_id
from kvbench.config import redundant_seed
from kvbench.job import run_job

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

MAIN_METHODS = ["fp16", "kivi", "kvquant", "gear", "turboquant", "svdq", "kqsvd", "cobra_mse", "cobra_kl",
                "h2o", "snapkv"]
UNSEEDED = {"fp16", "kivi", "h2o", "snapkv"}


def cfg_of(*overrides: str, hydra_cfg: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra_cfg)


def sweep_params(cfg) -> dict[str, list[str]]:
    return {k: str(v).split(",") for k, v in cfg.hydra.sweeper.params.items()}


# ---- identity ----------------------------------------------------------------------------------


def test_job_id_ignores_paths_tracking_and_labels():
    base = job_id(cfg_of("method=cobra_kl", "bpd=1.0"))
    assert len(base) == 16
    for same in (
        ["rerun=true"],
        ["wandb.mode=disabled", "wandb.project=elsewhere", "wandb.entity=me"],
        ["bpd=1"],  # typed as an int on the command line, a float in YAML: the same job
        ["task.batch_size=4"], ["task.batch_size=auto"],  # a batch gives what its rows give alone
    ):
        assert job_id(cfg_of("method=cobra_kl", "bpd=1.0", *same)) == base, same
    h2o = job_id(cfg_of("method=h2o", "bpd=1.0"))  # the kernel of H2O's recursion: the same result
    assert job_id(cfg_of("method=h2o", "bpd=1.0", "method.fused=off")) == h2o
    # labels: the experiment's name and the row that selected the other keys
    plain = OmegaConf.to_container(cfg_of("method=cobra_kl", "bpd=1.0"), resolve=True)
    assert job_id({**plain, "experiment": "ablation", "ablation_row": "k1_cobra_kl"}) == base
    # hydra.* (output directories, launcher) is never part of the identity
    with_hydra = cfg_of("method=cobra_kl", "bpd=1.0", "hydra.sweep.dir=/elsewhere",
                        "hydra/launcher=submitit_local", hydra_cfg=True)
    assert "hydra" in with_hydra and job_id(with_hydra) == base
    assert not EXCLUDED_KEYS & set(identity_config(with_hydra))


@pytest.mark.parametrize("change", [
    "method.c2=false", "method.rotation=none", "method.q_model=gauss", "bpd=0.5", "v_bpd=4",
    "seed=1", "limit=3", "tasks=[ppl,zeroshot]", "task.ppl.seqlen=1024", "calibration.n_windows=8",
    "model.path=/some/checkpoint", "method=cobra_mse",
])
def test_job_id_changes_with_what_is_computed(change):
    assert job_id(cfg_of("method=cobra_kl", "bpd=1.0", change)) != job_id(cfg_of("method=cobra_kl", "bpd=1.0"))


def test_is_done_needs_finished_status_and_same_id():
    for status in ("ok", "unsupported", "diverged"):
        assert is_done({"status": status, "job_id": "abc"}, "abc")
        assert not is_done({"status": status, "job_id": "abc"}, "abd")
        assert not is_done({"status": status}, "abc")  # a result from before job ids
    assert not is_done({"status": "failed", "job_id": "abc"}, "abc")
    assert not is_done(None, "abc")


def test_run_job_skips_finished_result_of_the_same_job(tmp_path):
    cfg = cfg_of("method=cobra_kl", "bpd=1.0", "wandb.mode=disabled")
    prior = {"status": "ok", "job_id": job_id(cfg), "model": "smollm2_135m", "method": "cobra_kl"}
    (tmp_path / "result.json").write_text(json.dumps(prior))
    assert run_job(cfg, tmp_path) == prior  # returned at once: no model is loaded


# ---- the seed rule -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", MAIN_METHODS)
def test_seed_rule(method):
    assert redundant_seed(cfg_of(f"method={method}", "seed=0")) is None
    why = redundant_seed(cfg_of(f"method={method}", "seed=3"))
    if method in UNSEEDED:
        assert why == f"seed 3 skipped: {method} has nothing random"
    else:
        assert why is None


def test_redundant_seed_writes_no_result(tmp_path):
    cfg = cfg_of("method=h2o", "seed=2", "wandb.mode=disabled")
    assert run_job(cfg, tmp_path) is None
    assert not (tmp_path / "result.json").exists()


# ---- experiment configs ------------------------------------------------------------------------


def rows_of(experiment: str, key: str, *extra: str) -> dict[str, object]:
    cfg = cfg_of(f"experiment={experiment}", hydra_cfg=True)
    params = sweep_params(cfg)
    assert cfg.hydra.sweep.dir == f"runs/{experiment}"  # stable: a rerun finds its jobs
    return {row: cfg_of(f"experiment={experiment}", f"{key}={row}", *extra) for row in params[key]}


@pytest.mark.parametrize("experiment,models,seeds,model_name", [
    ("main_table", ["llama3_8b", "mistral_7b", "qwen25_7b"], ["0", "1", "2", "3", "4"], None),
    ("smoke_main", None, ["0"], "smollm2_135m"),
])
def test_main_experiments(experiment, models, seeds, model_name):
    cfg = cfg_of(f"experiment={experiment}", hydra_cfg=True)
    params = sweep_params(cfg)
    assert params.get("model") == models
    assert params["seed"] == seeds
    assert cfg.experiment == experiment and list(cfg.tasks) == ["ppl", "zeroshot", "longbench"]
    cells = set()
    for row, c in rows_of(experiment, "main_row").items():
        if model_name:
            assert c.model.name == model_name
        assert c.v_bpd is None and c.experiment == experiment
        cells.add((c.method.name, c.bpd))
    expected = {("fp16", None)} | {(m, b) for m in MAIN_METHODS[1:] for b in (0.5, 1.0)}
    assert cells == expected  # every (method, budget) once, nothing invalid (no fp16 at 0.5)
    if experiment == "main_table":
        assert cfg_of("experiment=main_table").task.ppl.datasets == ["wikitext2", "ptb", "c4"]


def _row_key(c):
    """(method, K-track or KV-track, the options a row sets beyond the method's defaults)."""
    opts = {k: c.method[k] for k in ("decode", "joint_kv", "evict", "codec") if k in c.method}
    if "evict_options" in c.method and c.method.evict_options:
        opts["evict_decode"] = c.method.evict_options.get("decode")
    track = "K" if c.v_bpd is None else ("KV" if c.v_bpd == c.bpd else c.v_bpd)
    return c.method.name, track, tuple(sorted(opts.items()))


def test_frontier_baselines_and_ruler_rows():
    """Each row of the frontier, baselines and RULER experiments selects what its name says, at
    every budget of the sweep (the budget comes from the sweep, never from the row)."""
    frontier = {r: _row_key(c) for r, c in rows_of("frontier", "frontier_row", "bpd=2").items()}
    assert frontier["snapkv"] == ("snapkv", "K", (("decode", "keep"),))  # eviction: v_bpd null, K and V
    assert frontier["snapkv_evict"] == ("snapkv", "K", (("decode", "evict"),))
    assert frontier["cobra_plus_kv"] == ("cobra_plus", "KV", (("joint_kv", True),))
    assert frontier["snapkv_cobra_plus"][0] == "compose" and ("codec", "cobra_plus") in frontier["snapkv_cobra_plus"][2]
    assert ("evict_decode", "evict") in frontier["snapkv_kivi"][2]
    for m in ("kvquant", "gear", "turboquant", "kivi", "cobra_kl"):
        key = f"{m}_kv" if f"{m}_kv" in frontier else m
        assert frontier[key][:2] == (m, "KV")
    cfg = cfg_of("experiment=frontier", hydra_cfg=True)
    assert sweep_params(cfg)["seed"] == ["0", "1", "2"] and list(cfg.tasks) == ["ppl", "ruler"]
    assert cfg.task.ppl.limit == 4 and cfg.task.ppl.track == "B"

    baselines = {r: _row_key(c) for r, c in rows_of("baselines", "baseline_row", "bpd=4").items()}
    methods = ["kivi", "kvquant", "gear", "turboquant", "kqsvd", "cobra_kl", "cobra_plus"]
    assert {baselines[m][:2] for m in methods} == {(m, "K") for m in methods}
    assert set(baselines) == {"fp16", *methods}  # the sweep's K-track; the KV rows run at bpd=2
    kv = {m: _row_key(cfg_of("experiment=baselines", f"baseline_row={m}_kv", "bpd=2")) for m in methods}
    assert {kv[m][:2] for m in methods} == {(m, "KV") for m in methods}
    assert sweep_params(cfg_of("experiment=baselines", hydra_cfg=True))["bpd"] == ["1", "2", "4"]

    ruler = rows_of("ruler_smoke", "ruler_row", "bpd=4")
    assert all(c.bpd == 4 for r, c in ruler.items() if r != "fp16")
    assert ruler["snapkv_evict"].method.decode == "evict" and ruler["snapkv"].method.decode == "keep"
    assert sweep_params(cfg_of("experiment=ruler_smoke", hydra_cfg=True))["bpd"] == ["2", "4", "8"]


ABLATION_ROWS = {  # (model, method, bpd, v_bpd, c2, rotation): the seed's ablation table
    ("llama3_8b", "cobra_kl", 1.0, 4.0, True, "hadamard"),
    ("llama3_8b", "cobra_kl", 2.0, 3.0, True, "hadamard"),
    ("llama3_8b", "cobra_kl", 3.0, 2.0, True, "hadamard"),
    ("llama3_8b", "kqsvd", 1.0, 4.0, None, None),
    ("llama3_8b", "kqsvd", 2.0, 3.0, None, None),
    ("llama3_8b", "kqsvd", 3.0, 2.0, None, None),
    ("mistral_7b", "cobra_kl", 1.0, 5.0, True, "hadamard"),
    ("mistral_7b", "cobra_kl", 2.0, 4.0, True, "hadamard"),
    ("mistral_7b", "kqsvd", 1.0, 5.0, None, None),
    ("mistral_7b", "kqsvd", 2.0, 4.0, None, None),
    ("llama3_8b", "cobra_kl", 1.0, None, True, "hadamard"),
    ("llama3_8b", "cobra_kl", 1.0, None, False, "hadamard"),
    ("llama3_8b", "cobra_kl", 1.0, None, True, "none"),
}


def _ablation_key(c, model=None):
    return (model or c.model.name, c.method.name, c.bpd, c.v_bpd,
            c.method.get("c2"), c.method.get("rotation"))


def test_ablation_experiments():
    rows = rows_of("ablation", "ablation_row")
    assert {_ablation_key(c) for c in rows.values()} == ABLATION_ROWS and len(rows) == len(ABLATION_ROWS)
    assert all(list(c.tasks) == ["ppl", "longbench"] and c.experiment == "ablation" for c in rows.values())
    smoke = rows_of("smoke_ablation", "ablation_row")
    assert set(smoke) == set(rows)
    assert all(c.model.name == "smollm2_135m" for c in smoke.values())
    by_row = {r: _ablation_key(c) for r, c in rows.items()}
    assert {r: _ablation_key(c, model=by_row[r][0]) for r, c in smoke.items()} == by_row


@pytest.mark.parametrize("launcher,target", [
    ("basic", "BasicLauncher"), ("joblib", "JoblibLauncher"),
    ("submitit_local", "LocalLauncher"), ("slurm", "SlurmLauncher"),
])
def test_launcher_presets_compose(launcher, target):
    cfg = cfg_of(f"hydra/launcher={launcher}", hydra_cfg=True)
    assert cfg.hydra.launcher._target_.endswith(target)
    if launcher == "slurm":
        for key in ("partition", "gpus_per_node", "mem_gb", "timeout_min"):
            assert key in cfg.hydra.launcher


# ---- a resumable sweep through submitit_local --------------------------------------------------

# small and fast; calibration on the wiki_proxy calibration part (only the mechanics are under test here)
COMMON = [
    "tasks=[ppl]", "task.ppl.datasets=[ptb]", "task.ppl.seqlen=64", "limit=1",
    "calibration.n_windows=2", "calibration.seqlen=64", "calibration.dataset=wiki_proxy", "wandb.mode=disabled",
    "model.name=tiny_llama", "model.embedded=false", "model.chat=false",
]
JOBS = [(m, b, s) for m in ("h2o", "kqsvd") for b in ("7.0", "8.0") for s in ("0", "1")]


def tiny_checkpoint(path: Path) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer (GQA, head_dim 16), saved to ``path``."""
    from transformers import AutoTokenizer

    from conftest import save_tiny_checkpoint
    from kvbench.model.loading import smollm2_checkpoint

    tok = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    return save_tiny_checkpoint(path, tok, 256, tie_word_embeddings=True,
                                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


def job_dir(sweep: Path, method: str, bpd: str, seed: str) -> Path:
    return sweep / f"bpd={bpd},method={method},seed={seed}"


def log_count(d: Path, text: str) -> int:
    log = d / "run.log"
    return log.read_text().count(text) if log.exists() else 0


@pytest.mark.slow
def test_submitit_sweep_killed_and_rerun_runs_every_job_once(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    ckpt = tiny_checkpoint(tmp_path / "tiny")
    sweep = tmp_path / "sweep"
    overrides = [*COMMON, f"model.path={ckpt}"]
    cmd = [
        sys.executable, "-m", "kvbench.run", "-m", "hydra/launcher=submitit_local",
        f"hydra.sweep.dir={sweep}", "hydra.launcher.timeout_min=10",
        # the directory names only what the sweep varies: bpd=7.0,method=h2o,seed=0
        # (H2O holds its measured budget over 64 positions from 6.97 bpd up)
        "hydra.job.config.override_dirname.exclude_keys=[" + ",".join(
            o.split("=")[0] for o in overrides) + "]",
        "method=h2o,kqsvd", "bpd=7.0,8.0", "seed=0,1", *overrides,
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", KVBENCH_CACHE=str(tmp_path / "cache"))
    with open(tmp_path / "sweep1.log", "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and not list(sweep.rglob("result.json")):
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)  # the sweep and every job it started, mid-flight
        proc.wait()
    finished = {p.parent: p.read_bytes() for p in sweep.rglob("result.json")}
    runs = [j for j in JOBS if not (j[0] == "h2o" and j[2] == "1")]
    assert 0 < len(finished) < len(runs), (
        f"not killed part-way ({len(finished)} finished):\n" + (tmp_path / "sweep1.log").read_text()[-3000:])

    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]

    for method, bpd, seed in JOBS:
        d = job_dir(sweep, method, bpd, seed)
        if method == "h2o" and seed == "1":  # nothing random: no result, no run
            assert not (d / "result.json").exists()
            assert log_count(d, "seed 1 skipped: h2o has nothing random") == 2
            assert log_count(d, ": running in") == 0
            continue
        result = json.loads((d / "result.json").read_text())
        assert result["status"] == "ok", result.get("error")
        assert result["job_id"] == job_id(cfg_of(f"method={method}", f"bpd={bpd}", f"seed={seed}", *overrides))
        assert result["metrics"]["ppl"]["ptb"] > 0
        assert (result["method"], result["seed"], result["bpd"]["target_k"]) == (method, int(seed), float(bpd))
        if d in finished:  # finished before the kill: not run again
            assert (d / "result.json").read_bytes() == finished[d]
            assert log_count(d, ": running in") == 1
            assert log_count(d, "skipping") == 1
        else:  # killed or not started: run (again) until it finished, once
            assert 1 <= log_count(d, ": running in") <= 2
            assert log_count(d, "skipping") == 0
    ids = [json.loads(p.read_text())["job_id"] for p in sweep.rglob("result.json")]
    assert len(ids) == len(runs) == len(set(ids))
