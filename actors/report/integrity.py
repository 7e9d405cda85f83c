"""The run's integrity certificate: RUN_DIR/integrity.json, one verdict per check, each naming its culprits.

Checks: `weights` (did the engines serve exactly what the learner pushed, push after push), `caches` (was any
token sampled over keys and values an older weight version computed, where the engine promised to recompute
them) and `prompts` (where every prompt the buffer served went: `actors/buffer/accounting.py`).

The failures that cost RL users the most time are silent: weights that never reached an engine, an adapter never
merged, a restore of old weights. The learner records what every push's fingerprint check found
(`actors/learner/weight_checks.py`); this module turns the records into verdicts, which the head node's launcher
writes at the end of every run, its summary prints, and `tools/audit_run.py` reports.

A verdict is `pass` (checked, all as it should be), `fail` (with the culprits: which engine served other bits at
which version, in which tensors; a mismatch later repaired by a repush still fails the run's certificate, since
samples were generated meanwhile), `partial` (some engines or pushes could not be checked, with why) or
`not run` (with why). `ok` is whether no check failed; the checks cover what ran, `learner_steps` of it, which for
a run that failed (`run_failed`: why, as its launcher said) is what ran before the failure, not a finished run.

A run of several policies (actors.config.policies) gets a certificate per policy, in the policy's own directory
(RUN_DIR/policies/<name>/integrity.json, so a tool reading a policy's directory reads it as a one-policy run's): its
learner's pushes, its buffer's prompts, and the shared engines' caches (its own engines', for a policy that has
some). RUN_DIR/integrity.json then holds every policy's certificate under `policies`, the shared caches check once
under `checks`, and `ok` over them all: one file says whether the whole run is sound, one per policy says which
policy is not.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from actors.config.policies import policy_of_run_dir, policy_run_dir
from actors.runtime.metrics import read_metrics

FILE = "integrity.json"
WEIGHT_CHECKS = Path("metrics") / "weight_checks.jsonl"
TRAIN_METRICS = Path("metrics") / "train.jsonl"  # the learner's steps
KV_CACHE_LOGS = Path("metrics") / "kv_cache"  # one file per rollout worker: actors/rollout/kv_cache_log.py
SHOWN = 5  # culprits and reasons listed per check; the counts cover the rest


def weights_verdict(run_dir: Path) -> dict[str, Any]:
    """Did the engines serve exactly the weights the learner pushed, push after push?"""
    records = read_metrics(run_dir / WEIGHT_CHECKS)
    if not records:
        return {"verdict": "not run", "why": "no push was fingerprinted (--weight-check off, or no push ran)"}
    culprits = [{"version": r["version"], "engine": engine, "tensors": tensors,
                 **({"why": r["why"][engine]} if engine in (r.get("why") or {}) else {})}
                for r in records for engine, tensors in (r.get("differ") or {}).items()]
    unchecked = [f"version {r['version']}: {engine}: {why}"
                 for r in records for engine, why in (r.get("unchecked") or {}).items()]
    unchecked += [f"version {r['version']}: {r['not_checked']}" for r in records if r.get("not_checked")]
    matched = sum(len(r.get("matched") or ()) for r in records)
    verdict = "fail" if culprits else "partial" if unchecked else "pass"
    result: dict[str, Any] = {"verdict": verdict, "pushes": len(records), "engine_checks_matched": matched,
                              "served_differently": len(culprits), "unchecked": len(unchecked)}
    if culprits:
        result["culprits"] = culprits[:SHOWN]
    if unchecked:
        result["unchecked_why"] = unchecked[:SHOWN]
    return result


def caches_verdict(run_dir: Path) -> dict[str, Any]:
    """Did any engine sample a token over a KV cache older than its weights, after promising to recompute it?

    Read from the rollout workers' accounts (`actors/rollout/kv_cache_log.py`, counted by the engine where its cache
    is filled, not where it is dropped): per worker process the largest count, summed over a worker's restarts."""
    stale: dict[str, dict[int, int]] = {}
    recomputes: dict[str, bool] = {}
    prefix: dict[tuple[str, int], dict[str, int]] = {}  # (engine, pid) -> its prefix cache's latest counts
    for path in sorted((run_dir / KV_CACHE_LOGS).glob("*.jsonl")):
        engine = path.stem
        for record in read_metrics(path):
            if not {"pid", "stale_kv_tokens", "recomputes_on_update"} <= record.keys():
                continue  # not a worker's account (a hand-edited line): the rest still counts
            lives = stale.setdefault(engine, {})
            lives[record["pid"]] = max(lives.get(record["pid"], 0), int(record["stale_kv_tokens"]))
            recomputes[engine] = recomputes.get(engine, True) and bool(record["recomputes_on_update"])
            if isinstance(record.get("prefix_cache"), dict):
                life = prefix.setdefault((engine, record["pid"]), {})
                for name, count in record["prefix_cache"].items():
                    life[name] = max(life.get(name, 0), int(count))
    totals = {engine: sum(lives.values()) for engine, lives in stale.items()}
    if not totals:
        return {"verdict": "not run", "why": "no engine of the run accounts for its KV cache (an SGLang server's is "
                                             "flushed before every weight update instead, and an adapter version is "
                                             "loaded under a name of its own, which its prefix cache keys by)"}
    culprits = [{"engine": engine, "stale_kv_tokens": tokens}
                for engine, tokens in sorted(totals.items()) if recomputes[engine] and tokens]
    result: dict[str, Any] = {
        "verdict": "fail" if culprits else "pass", "engines": len(totals),
        "stale_kv_tokens": sum(tokens for engine, tokens in totals.items() if recomputes[engine]),
        "kept_by_setting": sum(tokens for engine, tokens in totals.items() if not recomputes[engine])}
    if culprits:
        result["culprits"] = culprits[:SHOWN]
    if prefix:
        result["prefix_cache"] = _prefix_cache_totals(prefix.values())
    return result


def _prefix_cache_totals(lives: Iterable[dict[str, int]]) -> dict[str, Any]:
    """The engines' prefix caches over the run: their counts summed over engines and restarts, and the share of
    prefilled sequences' tokens that came from a cache."""
    totals: dict[str, Any] = {}
    for life in lives:
        for name, count in life.items():
            totals[name] = totals.get(name, 0) + count
    total = totals.get("reused_tokens", 0) + totals.get("prefilled_tokens", 0)
    totals["hit_rate"] = round(totals.get("reused_tokens", 0) / total, 4) if total else 0.0
    return totals


def certify(run_dir: Path, *, prompts: dict[str, Any] | None = None, run_failed: str | None = None
            ) -> dict[str, Any]:
    """The certificate; `prompts` is the buffer's account of its prompts (`actors.buffer.accounting`), which the
    caller reads from the buffer's log (this module serves every role and reads none of their files);
    `run_failed`: why the run failed, where it did."""
    checks = {"weights": weights_verdict(run_dir), "caches": caches_verdict(engines_dir(run_dir)),
              "prompts": prompts or {"verdict": "not run", "why": "no account of the buffer's prompts was given"}}
    return {"ok": all(check["verdict"] != "fail" for check in checks.values()),
            "learner_steps": max((int(r["step"]) for r in read_metrics(run_dir / TRAIN_METRICS)
                                  if isinstance(r.get("step"), int)), default=0),
            "run_failed": run_failed, "checks": checks}


def engines_dir(run_dir: Path) -> Path:
    """Where the rollout workers that served `run_dir`'s learner keep their accounts: the run's directory, also for a
    policy's (RUN_DIR/policies/<name>) on the engines every policy shares; a policy's own for one with engines of its
    own (own_engines), whose workers keep them there."""
    if policy_of_run_dir(run_dir) is None or (run_dir / KV_CACHE_LOGS).is_dir():
        return run_dir
    return run_dir.parent.parent


def write_certificate(run_dir: Path, *, prompts: dict[str, Any] | None = None, run_failed: str | None = None
                      ) -> dict[str, Any]:
    certificate = certify(run_dir, prompts=prompts, run_failed=run_failed)
    (run_dir / FILE).write_text(json.dumps(certificate, indent=2) + "\n")
    return certificate


def write_policies_certificate(run_dir: Path, prompts: Mapping[str, dict[str, Any] | None], *,
                               run_failed: str | None = None) -> dict[str, Any]:
    """Each policy's certificate in its directory and the run's in RUN_DIR (the module docstring); `prompts`: each
    policy's buffer's account of its prompts, by policy name (the run's policies, in their order)."""
    policies = {name: write_certificate(policy_run_dir(run_dir, name), prompts=account, run_failed=run_failed)
                for name, account in prompts.items()}
    certificate = {"ok": all(own["ok"] for own in policies.values()), "run_failed": run_failed,
                   "checks": {"caches": caches_verdict(run_dir)}, "policies": policies}
    (run_dir / FILE).write_text(json.dumps(certificate, indent=2) + "\n")
    return certificate


def recorded_run_failure(run_dir: Path) -> str | None:
    """Why the run failed, as its launcher recorded in RUN_DIR/integrity.json at its end; None where it did not
    fail, or wrote no certificate (killed, or still running)."""
    try:
        recorded = json.loads((run_dir / FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    failure = recorded.get("run_failed") if isinstance(recorded, dict) else None
    return failure if isinstance(failure, str) else None


def describe(certificate: dict[str, Any], title: str = "integrity") -> list[str]:
    """The certificate as summary lines: one per check, culprits first. A failed run's headline says the checks
    cover only what ran before the failure: "OK" after "run failed" read as if all was well. A run of several
    policies: the shared caches once, then each policy's lines under its name."""
    if "policies" in certificate:
        return _describe_policies(certificate)
    if certificate.get("run_failed") is None:
        headline = f"{title}: {'OK' if certificate['ok'] else 'FAILED'}"
    else:
        steps = certificate.get("learner_steps", 0)
        scope = (f"of the {steps} learner step{'' if steps == 1 else 's'} that ran before the run failed" if steps
                 else "of what ran before the run failed, before its first learner step")
        headline = f"{title} ({scope}): {'no check failed' if certificate['ok'] else 'FAILED'}"
    lines = [headline]
    for name, check in certificate["checks"].items():
        if check["verdict"] == "not run":
            lines.append(f"  {name}: not run ({check['why']})")
        elif name == "weights":
            lines += _describe_weights(check)
        elif name == "caches":
            lines += _describe_caches(check)
        elif name == "prompts":
            lines += _describe_prompts(check)
    return lines


def _describe_policies(certificate: dict[str, Any]) -> list[str]:
    policies = certificate["policies"]
    if certificate.get("run_failed") is None:
        headline = f"integrity of {len(policies)} policies: {'OK' if certificate['ok'] else 'FAILED'}"
    else:
        headline = (f"integrity of {len(policies)} policies (of what ran before the run failed): "
                    f"{'no check failed' if certificate['ok'] else 'FAILED'}")
    lines = [headline]
    caches = certificate["checks"]["caches"]
    lines += ([f"  caches: not run ({caches['why']})"] if caches["verdict"] == "not run" else _describe_caches(caches))
    for name, own in policies.items():
        alone = {**own, "checks": {check: value for check, value in own["checks"].items() if check != "caches"}}
        lines += [f"  {line}" for line in describe(alone, title=f"policy {name}")]
    return lines


def _describe_weights(check: dict[str, Any]) -> list[str]:
    lines = [f"  weights: {check['verdict']} ({check['pushes']} pushes, {check['engine_checks_matched']} engine "
             f"checks matched, {check['served_differently']} served differently, {check['unchecked']} unchecked)"]
    lines += [f"    version {c['version']}: {c['engine']} "
              + (c.get("why") or f"serves other bits in {', '.join(c['tensors'][:3])}")
              for c in check.get("culprits", ())]
    lines += [f"    unchecked: {why}" for why in check.get("unchecked_why", ())]
    return lines


def _describe_caches(check: dict[str, Any]) -> list[str]:
    kept = f", {check['kept_by_setting']} over older KV kept by setting" if check["kept_by_setting"] else ""
    lines = [f"  caches: {check['verdict']} ({check['engines']} engines, {check['stale_kv_tokens']} tokens sampled "
             f"over KV of older weights{kept})"]
    lines += [f"    {c['engine']} sampled {c['stale_kv_tokens']} tokens over keys/values of older weights although "
              "it recomputes them at every update" for c in check.get("culprits", ())]
    prefix = check.get("prefix_cache")
    if prefix and (prefix.get("reused_tokens") or prefix.get("prefilled_tokens")):  # not for engines that never ran
        lines.append(f"    prefix cache: {100 * prefix['hit_rate']:.1f}% of prefill tokens reused "
                     f"({prefix.get('reused_tokens', 0)} reused, {prefix.get('prefilled_tokens', 0)} computed); "
                     f"{prefix.get('stale_tokens', 0)} held from older weights and "
                     f"{prefix.get('reprefilled_tokens', 0)} in flight at an update were prefilled again")
    return lines


def _describe_prompts(check: dict[str, Any]) -> list[str]:
    fates = ", ".join(f"{count} {fate}" for fate, count in check["fates"].items())
    again = check["regenerated"]
    lines = [f"  prompts: {check['verdict']} ({check['prompt_groups']} prompt groups: {fates}; {check['skipped']} "
             f"skipped; regenerated: {again['evictions']} evicted as stale, {again['leased_again']} leased again)"]
    samples = check.get("samples")
    segments = (samples or {}).get("trained_segments", 0)
    if samples is not None and (samples["left_out"] or samples["unaccounted"] or segments > samples["trained"]):
        forked = f" (as {segments} segments)" if segments > samples["trained"] else ""
        lines.append(f"    samples of trained groups: {samples['trained']} trained{forked}, {samples['left_out']} "
                     f"left out (failed), {samples['unaccounted']} unaccounted")
    for row in check.get("by_length", {}).get("buckets", ()):
        lines.append(f"    mean response length {row['lengths']}: {row['groups']} groups, {row['trained']} trained, "
                     f"{row['evictions']} evictions")
    bias = check.get("by_length", {}).get("evicted_vs_trained_length")
    if bias is not None:
        lines.append(f"    evicted answers were {bias:.2f}x as long as trained ones")
    if "note" in check:
        lines.append(f"    {check['note']}")
    return lines
