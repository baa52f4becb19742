"""W&B tracking without a model: the run's name, group, id, summary, labels and tables
(kvbench/store/wandb_keys.py, wandb_tables.py), the init fallbacks (wandb_run.py, with a stand-in
wandb), and the inert tracker of ``disabled`` and of a wrong mode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbench.store import wandb_keys as keys
from kvbench.store.tracking import Tracker, run_spec, start_tracking
from kvbench.store.wandb_tables import METRIC_COLUMNS, PREDICTION_COLUMNS, metric_rows, prediction_rows


def _result(**extra):
    return {"status": "ok", "error": None, "model": "llama3_8b", "method": "cobra_kl", "seed": 2,
            "job_id": "0123456789abcdef",
            "bpd": {"target_k": 1.0, "target_v": 4.0, "measured_k": 0.99, "measured_v": 4.0,
                    "convention": "Q-all", "by_task": {"zeroshot": {"measured_k": 0.98, "measured_v": 4.0}}},
            "metrics": {"ppl": {"wikitext2": 14.6},
                        "zeroshot": {"piqa": 0.75, "avg": 0.75, "acc": {"piqa": 0.7}, "acc_norm": {"piqa": 0.75},
                                     "metric": {"piqa": "acc_norm"}, "counts": {"piqa": 20},
                                     "split": {"piqa": "validation"}, "source": "hub", "eval_s": 3.5},
                        "longqa_squad": {"f1": 12.5, "n": 2, "item_seed": 0, "item_ids": ["a", "b"],
                                         "chat": True, "protocol": "query_aware", "eval_s": 1.0}},
            "counts": {"ppl_windows": {"wikitext2": 2}, "ppl_track": "A", "longqa_squad_items": 2},
            "timings": {"total_s": 1.0}, "config": {"experiment": "ablation", "bpd": 1.0, "v_bpd": 4.0, "seed": 2,
                                               "model": {"name": "llama3_8b"}, "method": {"name": "cobra_kl"}},
            "versions": {"git_commit": "abcdef0123456789"}, **extra}


def test_name_group_and_id(tmp_path):
    r = _result()
    assert keys.run_name(r) == "llama3_8b/cobra_kl/bpd1+v4/seed2"
    # before the job has set its targets: the budget as configured
    early = dict(r, bpd={"target_k": None, "target_v": None}, config={"bpd": 2.5, "v_bpd": "auto"})
    assert keys.run_name(early) == "llama3_8b/cobra_kl/bpd2.5+vauto/seed2"
    # group: the sweep directory (Hydra's multirun.yaml), else the experiment, else "single"
    sweep = tmp_path / "my_sweep"
    (sweep / "bpd=1,method=kivi").mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("{}")
    assert keys.group_name({"experiment": "ablation"}, sweep / "bpd=1,method=kivi") == "my_sweep"
    assert keys.group_name({"experiment": "ablation"}, tmp_path / "one") == "ablation"
    assert keys.group_name({}, tmp_path / "one") == keys.SINGLE != "adhoc"
    # the id: one per job, group and code version
    a = keys.run_id("g", "0123456789abcdef", "abcdef012345")
    assert len(a) == 16 and a == keys.run_id("g", "0123456789abcdef", "abcdef012345")
    assert a != keys.run_id("g", "0123456789abcdef", "fedcba987654")  # another commit: a new run
    assert a != keys.run_id("h", "0123456789abcdef", "abcdef012345")
    assert keys.run_id("g", None, "abcdef012345") is None
    assert keys.code_version({"git_commit": "abcdef0123456789"}) == "abcdef012345"
    assert keys.code_version({"git_commit": "abcdef0123456789-dirty"}).startswith("abcdef012345+")
    assert keys.code_version({}) == "unversioned"


def test_summary_is_numbers_in_one_unit_and_labels_go_to_config():
    r = _result()
    s = keys.summary_of(r)
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in s.values())
    assert s["metrics/zeroshot/piqa"] == pytest.approx(75.0)  # a fraction in result.json, percent here
    assert s["metrics/zeroshot/acc/piqa"] == pytest.approx(70.0)
    assert s["metrics/zeroshot/counts/piqa"] == 20 and s["metrics/zeroshot/eval_s"] == 3.5
    assert s["metrics/longqa_squad/f1"] == 12.5  # already percent
    assert s["bpd/measured_kv"] == pytest.approx((0.99 + 4.0) / 2) and s["bpd/target_kv"] == 2.5
    assert "metrics/zeroshot/metric/piqa" not in s and "status" not in s
    labels = keys.labels_of(r)
    assert labels["metrics/zeroshot/metric/piqa"] == "acc_norm"
    assert labels["counts/ppl_track"] == "A" and labels["bpd/convention"] == "Q-all"
    assert labels["metrics/longqa_squad/item_ids"] == ["a", "b"]
    final = keys.final_config(dict(r, status="failed", error="Traceback ...\nValueError: nope"))
    assert final["status"] == "failed" and final["error"] == "ValueError: nope"
    assert keys.UNITS["score"] == "percent"


def test_metric_and_prediction_rows():
    r = _result()
    rows = metric_rows(r)
    assert all(len(row) == len(METRIC_COLUMNS) for row in rows)
    by = {(row[5], row[6]): row for row in rows}
    assert by[("ppl", "wikitext2")][8:11] == [14.6, "perplexity", 2]
    assert by[("zeroshot", "piqa")][7:11] == ["acc_norm", 75.0, "percent", 20]
    assert by[("zeroshot", "piqa")][11:] == [0.98, 4.0]  # the task's measured bpd
    assert by[("longqa_squad", "longqa_squad")][7:11] == ["f1", 12.5, "percent", 2]
    preds = {"longqa_squad": [{"id": "q1", "prediction": "Paris", "answers": ["Paris", "paris"], "f1": 1.0,
                               "prompt_tokens": 2100, "context_tokens": 2100, "protocol_used": "query_aware",
                               "bpd_k": 1.0, "bpd_v": 16.0}],
             "ruler_wiki": [{"task": "vt", "max_length": 4096, "doc_id": 3, "prediction": "x", "answers": ["y"],
                             "score": 0.0, "prompt_tokens": 4000, "context_tokens": 3990}],
             "longbench": {"qasper": [{"_id": "z", "prediction": "", "answers": ["a"], "f1": 0.5,
                                       "prompt_tokens": 900}]}}
    tables = prediction_rows(r, preds)
    assert sorted(tables) == ["longbench", "longqa_squad", "ruler_wiki"]
    [row] = tables["longqa_squad"]
    assert len(row) == len(PREDICTION_COLUMNS)
    assert row[5:] == ["longqa_squad", "q1", 2100, 2100, "query_aware", "Paris", "Paris | paris", 100.0, 1.0, 16.0]
    assert tables["ruler_wiki"][0][5:7] == ["vt@4096", "3"] and tables["longbench"][0][12] == 50.0


class FakeWandb:
    """wandb.init that refuses what ``refuse`` says, and records every call."""

    def __init__(self, refuse):
        self.refuse, self.calls = refuse, []
        self.util = SimpleNamespace(generate_id=lambda: "fresh0001")

    def Settings(self, **kw):  # noqa: N802 - wandb's name
        return kw

    def init(self, **kw):
        self.calls.append((kw["mode"], kw["id"]))
        why = self.refuse(kw["mode"], kw["id"])
        if why:
            raise RuntimeError(why)
        return SimpleNamespace(id=kw["id"], mode=kw["mode"])


def test_online_init_falls_back_to_a_fresh_id_then_offline(caplog):
    from kvbench.store.wandb_run import open_run

    spec = {"id": "stable", "dir": "/tmp/job", "project": "p"}
    deleted = FakeWandb(lambda mode, i: "run stable was previously created and deleted" if i == "stable" else None)
    run = open_run(deleted, spec, "online", 5)
    assert (run.mode, run.id) == ("online", "fresh0001") and deleted.calls == [("online", "stable"), ("online", "fresh0001")]
    assert "fresh id fresh0001" in caplog.text
    offline = FakeWandb(lambda mode, i: "timed out" if mode == "online" else None)
    run = open_run(offline, spec, "online", 5)
    assert (run.mode, run.id) == ("offline", "stable") and "logging OFFLINE" in caplog.text
    with pytest.raises(RuntimeError):  # offline itself failing is start_tracking's to catch
        open_run(FakeWandb(lambda mode, i: "disk full"), spec, "offline", 5)


def test_disabled_and_bad_mode_are_inert(tmp_path, caplog):
    r = _result()
    for mode in ("disabled", "bogus"):
        tracker = start_tracking({"mode": mode}, r, tmp_path / mode)
        assert type(tracker) is Tracker and not tracker.enabled
        tracker.progress("ppl/ptb", 1, ppl=3.0)
        tracker.finish(r, {}, [], tmp_path / mode)
        assert not (tmp_path / mode).exists()
    assert "wandb.mode='bogus'" in caplog.text
    spec = run_spec(r, {"project": "kvbench"}, tmp_path / "job")
    assert spec["group"] == "ablation" and spec["config"]["kvbench"]["commit"] == "abcdef0123456789"
    assert spec["id"] == keys.run_id("ablation", r["job_id"], "abcdef012345")


def test_offline_tracker_writes_a_run_and_never_fails(tmp_path):
    pytest.importorskip("wandb")
    from wandb_records import kinds, records, run_file

    r = _result()
    tracker = start_tracking({"mode": "offline", "project": "kvbench"}, r, tmp_path / "job")
    assert tracker.enabled
    tracker.progress("ppl/ptb", 1, ppl=3.0, label="not a number", flag=True)
    tracker.finish(r, {"longqa_squad": "not records"}, [tmp_path / "missing.png"], tmp_path / "job")
    recs = records(run_file(tmp_path / "job"))  # a bad figure is logged and the run still closes
    assert kinds(recs)["exit"] == 1 and kinds(recs)["history"] >= 1


def test_an_older_wandb_sdk_gets_settings_and_reinit_it_understands():
    """GPU images may carry an older wandb: a Settings without the flush-interval field, and a
    ``reinit`` that is a bool before 0.19.10."""
    from kvbench.store.wandb_run import _reinit, _settings

    class OldSettings:
        def __init__(self, **kwargs):
            if "x_transaction_log_flush_interval" in kwargs:
                raise ValueError("extra fields not permitted")
            self.kwargs = kwargs

    class Old:
        __version__ = "0.17.5"
        Settings = OldSettings

    class New:
        __version__ = "0.31.0"

    assert _settings(Old, 5).kwargs == {"init_timeout": 5.0, "silent": True}
    assert _reinit(Old) is True and _reinit(New) == "finish_previous"
