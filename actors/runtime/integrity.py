"""The run's integrity certificate: RUN_DIR/integrity.json, one verdict per check, each naming its culprits.

The failures that cost RL users the most time are silent: weights that never reached an engine, an adapter never
merged, a restore of old weights. The learner records what every push's fingerprint check found
(`actors/learner/weight_checks.py`); this module turns the records into verdicts, which the head node's launcher
writes at the end of every run, its summary prints, and `tools/audit_run.py` reports.

A verdict is `pass` (checked, all as it should be), `fail` (with the culprits: which engine served other bits at
which version, in which tensors; a mismatch later repaired by a repush still fails the run's certificate, since
samples were generated meanwhile), `partial` (some engines or pushes could not be checked, with why) or
`not run` (with why).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from actors.runtime.metrics import read_metrics

FILE = "integrity.json"
WEIGHT_CHECKS = Path("metrics") / "weight_checks.jsonl"
SHOWN = 5  # culprits and reasons listed per check; the counts cover the rest


def weights_verdict(run_dir: Path) -> dict[str, Any]:
    """Did the engines serve exactly the weights the learner pushed, push after push?"""
    records = read_metrics(run_dir / WEIGHT_CHECKS)
    if not records:
        return {"verdict": "not run", "why": "no push was fingerprinted (--weight-check off, or no push ran)"}
    culprits = [{"version": r["version"], "engine": engine, "tensors": tensors}
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


def certify(run_dir: Path) -> dict[str, Any]:
    checks = {"weights": weights_verdict(run_dir)}
    return {"ok": all(check["verdict"] != "fail" for check in checks.values()), "checks": checks}


def write_certificate(run_dir: Path) -> dict[str, Any]:
    certificate = certify(run_dir)
    (run_dir / FILE).write_text(json.dumps(certificate, indent=2) + "\n")
    return certificate


def describe(certificate: dict[str, Any]) -> list[str]:
    """The certificate as summary lines: one per check, culprits first."""
    lines = [f"integrity: {'OK' if certificate['ok'] else 'FAILED'}"]
    for name, check in certificate["checks"].items():
        if check["verdict"] == "not run":
            lines.append(f"  {name}: not run ({check['why']})")
            continue
        lines.append(f"  {name}: {check['verdict']} ({check['pushes']} pushes, {check['engine_checks_matched']} "
                     f"engine checks matched, {check['served_differently']} served differently, "
                     f"{check['unchecked']} unchecked)")
        lines += [f"    version {c['version']}: {c['engine']} serves other bits in {', '.join(c['tensors'][:3])}"
                  for c in check.get("culprits", ())]
        lines += [f"    unchecked: {why}" for why in check.get("unchecked_why", ())]
    return lines
