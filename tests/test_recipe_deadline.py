"""The recipe's one clock and its end: a retry after halving the batch keeps the run's deadline, the time the
EAGLE-3 fit cannot use goes to regeneration (`FitPlan`), and a run whose head writes are slow still exits before
its deadline with its last best head and metrics in the export folder (stub stages, no compiles)."""
from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import time
from types import SimpleNamespace

import numpy as np
import pytest

from train_draft.recipe import Clock, FitPlan, RecipeConfig


def test_a_retry_after_halving_the_batch_keeps_the_runs_clock(tmp_path, monkeypatch):
    import train_draft.eagle3_fit as eagle3_fit
    from train_draft import recipe
    budgets, ckpts = [], []

    def fake_fit(target, train, out, cfg, *, time_budget_s, ckpt_every, **kw):
        budgets.append(time_budget_s)
        ckpts.append(ckpt_every)
        time.sleep(0.5)
        if cfg.batch_size > 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        return {"step": 3, "epochs": 0.5, "fit_config": cfg, "ahead": {"status": "none"}, "last_metrics": None,
                "best": None, "epoch_cap": {"steps": 10}, "sized_to_budget": {"probe_s_per_step": 0.1}, "seconds": 1}

    monkeypatch.setattr(eagle3_fit, "fit_eagle3", fake_fit)
    train = SimpleNamespace(n_tokens=10, mask=np.ones(10), seq_ids=["a"])
    cfg = dataclasses.replace(RecipeConfig(), eagle3=dataclasses.replace(RecipeConfig().eagle3, batch_size=8))
    r = recipe.eagle3_stage(None, train, None, cfg, tmp_path / "run", tmp_path / "head", 10.0, None, None, False)
    assert [x["batch_size"] for x in r["batch_retries"]] == [8, 4]
    assert budgets[0] <= 10.0 and budgets[1] <= budgets[0] - 0.45 and budgets[2] <= budgets[1] - 0.45, budgets
    assert ckpts == [None, None, None]  # no optimizer state saved: nothing reads it
    assert r["step_s"] == 0.1 and r["epoch_cap_steps"] == 10


def _plan(spare_to="regenerate", max_epochs=2.0, t0=1000.0, budget=100.0):
    cfg = RecipeConfig(budget_s=budget, spare_to=spare_to, eval_every=100, eval_batches=2, fit_overhead_s=5.0,
                       eagle3=dataclasses.replace(RecipeConfig().eagle3, seq_len=100, batch_size=1,
                                                  max_epochs=max_epochs))
    clock = Clock(cfg, None, t0=t0)
    plan = FitPlan(cfg, clock, clock.at(cfg.last_until), text_tokens=0)
    plan.timing = {"step_s": 0.1, "eval_batch_s": 0.05}
    return plan


def test_the_time_the_fit_cannot_use_goes_to_regeneration():
    plan = _plan()
    now = 1000.0 + 40.0  # past regen_until (35 s): the fit's share is 97 - 40 = 57 s
    # 20k tokens: 200 steps a epoch, 400 at the cap, 40 s + 5 s + 5 scores: the fit cannot use its 57 s
    p = plan.predict(20_000, now=now)
    assert p == {"steps": 400, "epoch_cap_steps": 400, "share_s": 57.0, "limited_by": "epoch cap"}
    assert plan.fit_seconds(400) == pytest.approx(5.0 + 40.0 + 5 * 2 * 0.05)
    assert not plan.stop_regen(None, 32, {"new_ids": 20_000}, now)  # so regeneration goes on
    assert plan.stop_regen(None, 32, {"new_ids": 40_000}, now)  # 800 steps: more than the share holds
    assert plan.record["regen_past_share_s"] == 5.0 and plan.record["regen_ended_s"] == 40.0
    # "epochs": regeneration keeps to its share, the fit has no cap
    epochs = _plan("epochs")
    assert epochs.stop_regen(None, 32, {"new_ids": 20_000}, now)
    assert epochs.predict(20_000, now=now)["limited_by"] == "time"
    # before regen_until regeneration always goes on; without a measurement it ends there
    now = 1000.0 + 20.0
    assert not plan.stop_regen(None, 32, {"new_ids": 0}, now)
    unmeasured = _plan()
    unmeasured.timing = None
    now = 1000.0 + 36.0
    assert unmeasured.stop_regen(None, 32, {"new_ids": 0}, now)


# ------------------------------------------------------------------------- slow head writes, a short deadline

WRITE_S = 12.0


def _slow_run(out, export, deadline):
    """A recipe with stub stages (no compiles) whose head writes take WRITE_S seconds each."""
    import train_draft.export_dir as export_dir
    from ddd_jax import eagle, eagle3
    from ddd_jax.checkpoints.ours import save_draft
    from tests.test_recipe import TINY, fake_inputs, tiny_target
    from train_draft import recipe
    from train_draft.eagle3_fit import eagle3_config
    real_write = export_dir.write_head_tar

    def slow_write(draft, path, extra=None, limit=export_dir.MAX_FILE_BYTES):
        time.sleep(WRITE_S)
        return real_write(draft, path, extra, limit)

    def fake_regenerate(target, inputs, cfg, regen_dir, time_limit_s, progress, stop=None):
        regen_dir.mkdir(parents=True, exist_ok=True)
        for part in ("holdout", "train"):
            lines = [json.dumps({"id": k, "prompt_len": len(ids), "ids": ids + [5, 6, 7, 1], "finished": True})
                     for k, ids in inputs[part]]
            (regen_dir / f"{part}.jsonl").write_text("".join(x + "\n" for x in lines))
        return {"new_reply_tokens": 4 * len(inputs["train"])}

    def fake_fit(target, train, held, cfg, run_dir, head_dir, budget_s, init, on_best, progress, ahead=None,
                 stop=None):
        import jax
        dcfg = eagle3_config(target, 32)
        params = {**jax.tree.map(np.asarray, eagle3.init_params(dcfg, jax.random.PRNGKey(0), np.float32)),
                  "d2t": np.arange(32, dtype=np.int32)}
        run_dir.mkdir(parents=True, exist_ok=True)
        end, step, best = time.time() + budget_s, 0, None
        while time.time() < end and not (stop is not None and stop()):
            step += 1
            best = {"step": step, "eval": {"loss": 1.0 / step, "acc0": 0.5}}
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"split": "eval", "step": step, "loss": 1.0 / step}) + "\n")
            on_best(params, step, best["eval"])
            time.sleep(0.5)
        save_draft(eagle.Draft(dcfg, params, target), head_dir, dtype=np.float16)
        return {"steps": step, "best": best}

    export_dir.write_head_tar = slow_write
    recipe.regenerate_stage, recipe.eagle3_stage = fake_regenerate, fake_fit
    t = tiny_target()
    cfg = dataclasses.replace(TINY, train_eagle1="off", acceptance="off", compile_ahead=False)
    recipe.run_recipe(t, fake_inputs(t), out, cfg, progress=False, export_dir=export, deadline=deadline)


@pytest.mark.deep  # about 55 s, most of it sleeping: make test-deep
def test_slow_head_writes_end_before_the_deadline_with_the_last_best_head(tmp_path):
    from ddd_jax import load_draft
    from tests.test_recipe import tiny_target
    from train_draft.export_dir import check_limits
    out, export = tmp_path / "run", tmp_path / "out"
    deadline = time.time() + 55.0
    proc = mp.get_context("spawn").Process(target=_slow_run, args=(out, export, deadline))
    proc.start()
    proc.join(deadline - time.time() + 30)
    ended = time.time()
    assert proc.exitcode == 0 and ended < deadline, (proc.exitcode, ended - deadline)
    assert check_limits(export)["problems"] == []
    assert sorted(p.name for p in export.iterdir()) == ["eagle3-metrics.jsonl.gz", "recipe.json", "regen.npz",
                                                         "tiny4-eagle3.tar"]  # and no temporary file
    rec = json.loads((export / "recipe.json").read_text())
    assert rec["exported"]["tiny4-eagle3.tar"] == "written (float16)"
    last = rec["stages"]["eagle3"]["best"]["step"]
    import tarfile
    with tarfile.open(export / "tiny4-eagle3.tar") as tar:
        extra = json.loads(tar.extractfile("config.json").read())["extra"]
    assert extra["step"] == last  # the fit's last best, not an earlier one
    assert load_draft(str(export / "tiny4-eagle3.tar"), tiny_target()).config.head_type == "eagle3"
