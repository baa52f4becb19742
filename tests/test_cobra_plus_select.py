"""The selection of cobra_plus's defaults (docs/methods.md §13, §1.2): the coordinate descent, the
stated search, the job that runs it, and the shipped defaults against the shipped table."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from conftest import REPO
from kvbench.fit.cobra_plus_select import Stage, descend, main, render, stages_from_config
from methods import build_method
from methods.cobra_plus import CobraPlus
from test_run import FAST, tiny_checkpoint  # noqa: F401  (the fixture)

SHIPPED = REPO / "docs" / "cobra_plus_select.json"
ORDER = {"a": [{"a": 0}, {"a": 1}, {"a": 2}], "b": [{"b": "x"}, {"b": "y"}], "c": [{"c": False}, {"c": True}]}


def experiment_cfg(*overrides):
    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        return compose("config", ["experiment=cobra_plus_select", *overrides])


class Counting:
    """A fake score: perplexity = f(options) on 4 'windows', counting distinct evaluations."""

    def __init__(self, f):
        self.f, self.seen = f, {}

    def __call__(self, options, stage):
        key = json.dumps(options, sort_keys=True)
        if key not in self.seen:
            self.seen[key] = self.f(options)
        p = self.seen[key]
        return {"ppl": p, "window_ppl": [p * (1 + 0.01 * i) for i in range(4)]}


def brute_force(f, order) -> dict:
    points = [dict(itertools.chain.from_iterable(v.items() for v in combo)) for combo in itertools.product(*order.values())]
    return min(points, key=f)


def test_descent_on_a_separable_objective_reaches_the_brute_force_optimum():
    """Separable: one pass moves every part to its optimum, the second confirms (and scores only
    what it has not seen)."""
    cost = {"a": {0: 3.0, 1: 1.0, 2: 2.0}, "b": {"x": 0.5, "y": 0.0}, "c": {False: 0.0, True: 0.25}}

    def f(o):
        return 10.0 + sum(cost[k][o[k]] for k in cost)

    score = Counting(f)
    point, steps, converged = descend(Stage("s", 1.0, None, {"a": 0, "b": "x", "c": True}, ORDER), {}, score, 3)
    best = brute_force(f, ORDER)
    assert point == best and converged
    assert [s["pass"] for s in steps] == [1, 1, 1, 2, 2, 2]
    assert [s["moved"] for s in steps] == [True, True, True, False, False, False]
    # pass 1: the start, a's 2 others, then b's and c's 1 other each; pass 2 around (1, y, False):
    # a's 2 others and b's other are new, c's other was scored in pass 1
    assert len(score.seen) == 1 + 2 + 1 + 1 + 2 + 1
    for s in steps:  # exactly one current and one chosen candidate per step; chosen = lowest PPL
        assert sum(r["current"] for r in s["candidates"]) == 1 and sum(r["chosen"] for r in s["candidates"]) == 1
        chosen = next(r for r in s["candidates"] if r["chosen"])
        assert chosen["ppl"] == min(r["ppl"] for r in s["candidates"])


def test_descent_keeps_the_current_value_on_a_tie_and_skips_unreachable_values():
    def score(options, stage):
        if options["a"] == 2:
            return {"ppl": None, "unsupported": "out of range"}
        return {"ppl": 5.0, "window_ppl": [5.0]}

    point, steps, converged = descend(Stage("s", 1.0, None, {"a": 1, "b": "y", "c": False}, ORDER), {}, score, 3)
    assert point == {"a": 1, "b": "y", "c": False} and converged and len(steps) == 3
    assert not any(r["chosen"] for r in steps[0]["candidates"] if r["unsupported"])


def test_descent_stops_at_max_passes_and_says_so():
    """A coupled objective that keeps moving: the stage reports it did not converge."""
    def f(o):  # the best b depends on a, the best a on b: a cycle of improvements
        return 10.0 - 0.1 * o["a"] - (1.0 if (o["b"] == "y") == (o["a"] % 2 == 0) else 0.0)

    point, steps, converged = descend(Stage("s", 1.0, None, {"a": 0, "b": "x", "c": False}, ORDER), {}, Counting(f), 1)
    assert not converged and {s["pass"] for s in steps} == {1}


def test_start_value_outside_the_listed_values_is_scored_as_the_reference():
    score = Counting(lambda o: 1.0 + o["a"])
    point, steps, _ = descend(Stage("s", 1.0, None, {"a": 7, "b": "x", "c": False}, ORDER), {}, score, 2)
    first = steps[0]["candidates"]
    assert first[0]["value"] == "(start)" and first[0]["current"] and point["a"] == 0


def test_bool_and_number_values_are_told_apart():
    order = {"c2": [{"c2": True}, {"c2": "exact"}], "clip_scale": [{"clip_scale": 1}, {"clip_scale": 2.0}]}
    seen = []

    def score(options, stage):
        seen.append(dict(options))
        return {"ppl": 1.0, "window_ppl": [1.0]}

    point, steps, _ = descend(Stage("s", 1.0, None, {"c2": True, "clip_scale": 2}, order), {}, score, 1)
    assert [r["current"] for r in steps[0]["candidates"]] == [True, False]
    assert [r["current"] for r in steps[1]["candidates"]] == [False, True]  # 2 == 2.0 (YAML ints)


def test_stated_search_is_valid_and_every_candidate_builds():
    cfg = experiment_cfg()
    stages = stages_from_config(cfg.select)
    assert [s.name for s in stages] == ["k_track", "kv_track"]
    assert int(cfg.select.heldout_windows) >= 8
    assert (stages[0].bpd_k, stages[0].bpd_v) == (1.0, None) and stages[1].bpd_v is not None
    options = OmegaConf.to_container(cfg.method, resolve=True)
    name = options.pop("name")
    for stage in stages:
        for values in stage.order.values():
            for v in values:
                build_method(name, **{**options, **stage.start, **v})
    with pytest.raises(ValueError, match="not cobra_plus options"):
        stages_from_config({"stages": [{"name": "x", "bpd": 1, "order": {"rank": [1, 2]}}]})


def replay(table) -> tuple[dict, list]:
    """The descent again, its scores read from the table: the recorded steps and choice must follow."""
    point, out = dict(table["steps"][0]["candidates"][0]["options"]), []
    for raw in table["search"]["stages"]:
        stage = Stage(**raw)
        point, steps, _ = descend(stage, point, lambda options, st: score_of(table, st.name, options),
                                  table["search"]["max_passes"])
        out += steps
    return point, out


def score_of(table, stage_name, options):
    """The recorded score of the candidate ``options`` (every row records the searched options)."""
    for step in table["steps"]:
        if step["stage"] != stage_name:
            continue
        for r in step["candidates"]:
            if r["options"] == options:
                return {"ppl": r["ppl"], "window_ppl": r["window_ppl"], "unsupported": r["unsupported"]}
    raise KeyError(f"no recorded candidate {options}")


@pytest.mark.skipif(not SHIPPED.exists(), reason="docs/cobra_plus_select.json not written yet")
def test_shipped_defaults_equal_the_shipped_selection():
    table = json.loads(SHIPPED.read_text())
    defaults = CobraPlus()
    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        method_yaml = OmegaConf.to_container(compose("config", ["method=cobra_plus"]).method)
    for key, value in table["chosen"].items():
        assert getattr(defaults, key) == value, key
        assert method_yaml[key] == value, f"conf/method/cobra_plus.yaml: {key}"
    # the table comes from the stated search, on >= 8 held-out windows, and is self-consistent
    cfg = experiment_cfg()
    assert table["search"]["stages"] == [dataclasses.asdict(s) for s in stages_from_config(cfg.select)]
    assert table["search"]["max_passes"] == cfg.select.max_passes
    assert table["heldout_windows"][0] >= 8 and table["seed"] == 0
    assert all(table["converged"].values())
    point, steps = replay(table)
    assert {k: point[k] for k in table["chosen"]} == table["chosen"]
    assert [(s["stage"], s["pass"], s["part"], s["moved"]) for s in steps] == \
           [(s["stage"], s["pass"], s["part"], s["moved"]) for s in table["steps"]]
    for step in table["steps"]:
        for r in step["candidates"]:
            if r["ppl"] is not None:
                assert math.isclose(r["ppl"], math.exp(sum(map(math.log, r["window_ppl"])) / len(r["window_ppl"])))


def test_job_runs_the_selection_and_the_table_is_rebuilt_from_the_run(tmp_path, tiny_checkpoint, monkeypatch, capsys, one_thread):
    from kvbench.job import run_job

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    cfg = experiment_cfg(f"model.path={tiny_checkpoint}", *FAST, "task.ppl.datasets=[ptb]")
    with open_dict(cfg):
        cfg.select.stages = [{"name": "k_track", "bpd": 1.0, "v_bpd": None, "start": {"q_model": "seed"},
                              "order": {"q_model": ["seed", "gauss"], "clip_scale": [1.0, 2.0]}}]
    result = run_job(cfg, tmp_path / "run")
    assert result["status"] == "ok", result["error"]
    table = result["cobra_plus_select"]
    assert table["heldout_windows"] == [8, 64] and table["candidates"] == 3 and table["scored_now"] == 3
    first, second = table["steps"][:2]
    best = min(first["candidates"], key=lambda r: r["ppl"])
    assert table["chosen"]["q_model"] == best["value"]
    assert result["config"]["select"]["stages"][0]["order"]["q_model"] == ["seed", "gauss"]
    assert (tmp_path / "run" / "cobra_plus_select.md").read_text() == render(table)
    again = run_job(cfg, tmp_path / "again")
    assert again["cobra_plus_select"]["scored_now"] == 0  # every candidate from the cache
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "doc" / "t")]) == 0
    assert json.loads((tmp_path / "doc" / "t.json").read_text())["chosen"] == table["chosen"]
    assert "| k_track (1, 16) | 1 | q_model |" in capsys.readouterr().out
