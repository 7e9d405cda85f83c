"""How tools/hostile/campaign.py judges an attack: what the receiver counted, read from its heartbeat counters.

The counters are the ones every actor sends with its heartbeats and the controller records in
metrics/actors.jsonl (``bus.sockets.DropLog.metrics``): the difference between the record after the attack and
the one before it is what the attack caused. Kinds whose frames reach the actor must be counted exactly, under
the peer label of the connections that sent them; the others have their own evidence (a dropped connection, a
duplicate answered from the cache, a refused claim).

A receiver's drop table keeps 32 peer rows and folds the lightest into "(other)" when a new sender's first drop
finds it full (`bus.sockets.DropLog`). The random-identity flood fills it, so a labelled attack's row can be
folded while it is still light, and the frames counted in it before then land in "(other)", which the flood's
own count reads. Those frames were counted, just not under their sender: when the flood's surplus equals the
labelled attacks' shortfall exactly, every frame is accounted for and the attacks pass, saying so.
"""

from __future__ import annotations

import math
from typing import Any

from tools.hostile.plan import REPLAY_REPEATS, RPC_CHANNELS, Attack
from tools.hostile.run import Endpoint


class Counters:
    """What the receivers counted during the attack: the last heartbeat record minus the one before the attack."""

    def __init__(self, before: dict[str, Any], after: dict[str, Any]) -> None:
        self.delta = {key: value - before.get(key, 0.0) for key, value in after.items()
                      if isinstance(value, (int, float)) and "/" in key}
        # "{actor}/dropped_by.{channel}.{peer}.{reason}": channel and reason hold no dot, a peer label may.
        self.rows: dict[tuple[str, str], dict[str, dict[str, float]]] = {}
        for key, value in self.delta.items():
            actor, metric = key.split("/", 1)
            if metric.startswith("dropped_by.") and value:
                channel, rest = metric[len("dropped_by."):].split(".", 1)
                label, reason = rest.rsplit(".", 1)
                self.rows.setdefault((actor, channel), {}).setdefault(label, {})[reason] = value

    def get(self, actor: str, metric: str) -> float:
        return self.delta.get(f"{actor}/{metric}", 0.0)

    def peer_row(self, endpoint: Endpoint, label: str) -> dict[str, float]:
        return self.rows.get((endpoint.actor, endpoint.channel), {}).get(label, {})

    def peer_labels(self, endpoint: Endpoint) -> set[str]:
        return set(self.rows.get((endpoint.actor, endpoint.channel), {}))

    def total(self, endpoint: Endpoint) -> float:
        prefix = f"{endpoint.actor}/dropped.{endpoint.channel}."
        return sum(value for key, value in self.delta.items() if key.startswith(prefix))

    def matching(self, actor: str, prefix: str) -> dict[str, float]:
        return {key.split("/", 1)[1]: value for key, value in self.delta.items()
                if key.startswith(f"{actor}/{prefix}") and value}


def _reasons(row: dict[str, float]) -> str:
    return " ".join(f"{reason}:{int(count)}" for reason, count in sorted(row.items())) or "nothing"


def judge(attacks: list[Attack], counters: Counters, actor_ids: list[str]) -> None:
    """Fill each attack's ``counted`` (what the receiver's counters say) and ``ok``."""
    by_endpoint: dict[Endpoint, list[Attack]] = {}
    for attack in attacks:
        by_endpoint.setdefault(attack.endpoint, []).append(attack)
    for group in by_endpoint.values():
        labelled = {attack.label for attack in group if attack.label.startswith("hostile-")}
        for attack in group:
            _judge_one(attack, counters, labelled, actor_ids)
        _settle_folded_rows(group)


def _settle_folded_rows(group: list[Attack]) -> None:
    """Frames counted in "(other)" after their row was folded: see the module docstring."""
    flood = next((attack for attack in group if attack.kind == "idents"), None)
    if flood is None or flood.missing >= 0 or flood.unsent:
        return
    short = [attack for attack in group if attack is not flood and attack.missing > 0 and not attack.unsent]
    surplus = -flood.missing
    if surplus != sum(attack.missing for attack in short):
        return
    for attack in short:
        attack.counted += f"; {attack.missing} more in (other): its row was folded when the peer table filled"
        attack.ok = True
    flood.counted += f"; {surplus} of them other attacks' (folded rows)"
    flood.ok = True


def _judge_one(attack: Attack, counters: Counters, labelled: set[str], actor_ids: list[str]) -> None:
    endpoint, kind, sent = attack.endpoint, attack.kind, attack.sent
    row = counters.peer_row(endpoint, attack.label)
    if attack.raw is not None:
        if kind == "unfinished":
            attack.counted, attack.ok = "half messages discarded by libzmq (nothing reaches the actor)", True
        else:
            attack.counted = f"connection dropped by the receiver: {attack.closed}/{len(attack.idents)}"
            attack.ok = attack.closed == len(attack.idents)
        return
    if kind in ("random", "truncated", "wrong_types", "envelope", "credit"):
        attack.missing = sent - int(sum(row.values()))
        attack.counted, attack.ok = _reasons(row), attack.missing == 0
    elif kind in ("not_sub", "pub_envelope"):
        # XPUB does not say which connection sent a frame: its drops are all the sender address's.
        reason = "not_subscription" if kind == "not_sub" else "bad_envelope"
        counted = counters.get(endpoint.actor, f"dropped.publish.{reason}")
        attack.counted, attack.ok = f"{reason}:{int(counted)} (all from subscriber@127.0.0.1)", counted == sent
    elif kind == "identity":
        rows = {name: counters.peer_row(endpoint, name) for name in actor_ids if name != endpoint.actor}
        counted = sum(sum(r.values()) for r in rows.values())
        attack.counted = f"under real names: {int(counted)} ({_reasons(_merge(rows.values()))})"
        attack.missing = sent - int(counted)
        attack.ok = counted == sent
    elif kind == "idents":
        others = counters.peer_labels(endpoint) - labelled - set(actor_ids)
        rows = [counters.peer_row(endpoint, label) for label in others]
        counted = sum(sum(r.values()) for r in rows)
        attack.counted = f"{len(others)} rows incl. (other): {int(counted)} ({_reasons(_merge(rows))})"
        attack.missing = sent - int(counted)
        attack.ok = counted == sent
    elif kind == "no_hello":
        delivered = counters.get(endpoint.actor, "dropped.unhandled.Heartbeat")
        attack.counted = f"{_reasons(row)}; delivered first (unhandled): {int(delivered)}"
        # Without a single over_credit drop the credit check itself failed: nothing to settle.
        attack.missing = sent - int(row.get("over_credit", 0) + delivered) if row.get("over_credit", 0) else 0
        attack.ok = row.get("over_credit", 0) > 0 and attack.missing == 0
    elif kind == "hellos":
        unread = row.get("credit_unread", 0)
        attack.counted = f"answered {attack.answered}, credit_unread:{int(unread)}"
        attack.missing = sent - int(attack.answered + unread)
        attack.ok = attack.missing == 0
    elif kind == "replay" and endpoint.channel in RPC_CHANNELS:
        duplicates = counters.get(endpoint.actor, f"duplicates.{endpoint.channel}")
        expected = sent - math.ceil(sent / REPLAY_REPEATS)
        attack.counted, attack.ok = f"duplicates answered from cache: {int(duplicates)}", duplicates >= expected
    elif kind == "replay":
        data = sent - len(attack.idents)  # the hellos first
        if endpoint.actor == "buffer":
            ignored = counters.get("buffer", "groups.ignored.stale_lease")
            attack.counted, attack.ok = f"groups.ignored.stale_lease: {int(ignored)}", ignored >= data > 0
        else:
            unhandled = counters.get(endpoint.actor, "dropped.unhandled.ScoredGroup")
            attack.counted, attack.ok = f"unhandled.ScoredGroup: {int(unhandled)}", unhandled == data > 0
    elif kind == "claims":
        refused = counters.matching("controller", "refused.")
        attack.counted, attack.ok = _reasons(refused), sum(refused.values()) >= sent
    elif kind == "registers":
        rosters = counters.get("controller", "published.publish")
        attack.counted, attack.ok = f"admitted (no CURVE); roster broadcasts: {int(rosters)}", True
    elif kind == "subs":
        subscriptions = counters.get("controller", "subscriptions.publish")
        replayed = counters.get("controller", "replayed.publish")
        attack.counted = f"subscriptions:{int(subscriptions)} replays sent:{int(replayed)}"
        attack.ok = subscriptions >= sent
    attack.ok = attack.ok and attack.unsent == 0


def _merge(rows: Any) -> dict[str, float]:
    merged: dict[str, float] = {}
    for row in rows:
        for reason, count in row.items():
            merged[reason] = merged.get(reason, 0.0) + count
    return merged
