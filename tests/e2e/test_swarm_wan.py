"""A swarm over a wide-area network: a bootstrap peer and two real `sapo-node` peers on 127.0.0.1, each behind
a relay of the loopback WAN (scripts/bench/relay.py) that adds 100-150 ms of round trip. Groups must flow
(each peer trains on the other's), and the round must not wait for the network: its publish is handed to the
background and the external groups it trains on were fetched and verified while it generated. Asserted on
the structure of the records (what the round waited, against what the network took), not on durations.
"""

from __future__ import annotations

import pytest

from conftest import live_metrics as rounds
from conftest import prefix_of, sources, start_bootstrap, start_node, stop_all, wait_for
from helpers_learning import check_records
from scripts.bench.relay import Link, Wan

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_groups_flow_over_a_slow_link_and_the_round_does_not_wait_for_it(tmp_path):
    swarm = "e2e-wan"
    links = [Link(delay_s=0.05), Link(delay_s=0.06, jitter_s=0.01), Link(delay_s=0.075)]  # 100, 120, 150 ms RTT
    rtt = min(link.rtt_s for link in links)
    with Wan() as wan:
        host, announce, boot_relay = wan.relayed(links[0])
        boot, maddrs = start_bootstrap(tmp_path, swarm, host=host, announce=announce)
        assert all(announce + "/p2p/" in m for m in maddrs), maddrs  # peers dial the bootstrap's relay
        run_dirs = [tmp_path / f"peer{i}" for i in range(2)]
        relays, nodes = [], []
        for i, d in enumerate(run_dirs):
            host, announce, relay = wan.relayed(links[1 + i])
            relays.append(relay)
            # rounds of the tiny model are shorter than a fetch over this link: with the default (--net-max-age 0)
            # each would wait for the rest of its fetch; 3 lets them run ahead, so that most do not wait at all
            flags = ["--net-max-age", "3"]
            nodes.append(start_node(d, maddrs, swarm, *flags, seed=i, host=host, announce=announce))
        try:
            keys = [prefix_of(d) for d in run_dirs]

            def both_trained_on_the_other() -> bool:
                return all(keys[1 - i] in sources(rounds(d)) for i, d in enumerate(run_dirs))

            wait_for(both_trained_on_the_other, nodes, 120, "each peer training on the other's groups over the WAN")
        finally:
            codes = stop_all(nodes)
            boot.stop()
        assert codes == [0, 0], [n.text()[-2000:] for n in nodes]
        for relay in (boot_relay, *relays):  # every peer was reached through its relay
            assert relay.stats.connections > 0 and relay.stats.bytes_in > 0 and relay.stats.bytes_out > 0
    for i, d in enumerate(run_dirs):
        recs = rounds(d)
        check_records(recs)
        assert [r["round"] for r in recs] == list(range(len(recs)))
        assert all(r["net_pipeline"] for r in recs)
        # publishing is handed to the background: no round waits a round trip for it
        assert all(r["phase_s"]["publish"] < rtt for r in recs), [r["phase_s"] for r in recs]
        # a round takes the prefetch that is ready, without waiting, unless the staleness bound made it wait
        assert all(r["phase_s"]["fetch"] < rtt for r in recs if not r["prefetch_waited"]), [r["phase_s"] for r in recs]
        trained = [r for r in recs if r["num_external"] > 0]
        assert trained and all(keys[1 - i] in r["external_sources"] for r in trained)
        # ... whose groups the network took longer than a round trip to bring
        assert all(r["prefetch_s"] > rtt for r in trained), [r["prefetch_s"] for r in trained]
        for r in trained:
            assert len(r["external_age_rounds"]) == len(r["external_age_s"]) == r["num_external"]
            assert all(0 <= age <= r["net_max_age"] for age in r["external_age_rounds"])
            assert all(age >= 0 for age in r["external_age_s"])
