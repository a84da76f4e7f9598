"""The swarm's typed settings: what a node's flags become, where its files go, and an exchange built from them
(constructed only: the DHT itself is exercised in tests/p2p and tests/e2e)."""

from dataclasses import fields

from node.build import swarm_settings as settings_from_config
from node.build import verify_config
from node.learn.tasks import PRESETS
from node.ops.config import load_config
from node.swarm.dht_exchange import DhtExchange
from node.swarm.reputation import REPUTATION_FILE
from node.swarm.settings import SwarmFiles, SwarmSettings
from node.swarm.verify import VerifyConfig
from p2p.identity import KEY_FILENAME, LIBP2P_IDENTITY_FILENAME
from p2p.pow import POW_FILENAME, check_pow, tier_difficulty

MIX = PRESETS["smoke"]
FLAGS = [
    "--swarm",
    "s1",
    "--model",
    "tiny-random",
    "--seed",
    "7",
    "--peers",
    "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWx",
    "--host-maddrs",
    "/ip4/127.0.0.1/tcp/0",
    "--client-mode",
    "--window",
    "3",
    "--net-timeout",
    "8",
    "--verify-budget-mb",
    "4",
    "--fetch-max",
    "5",
    "--pow-difficulty",
    "2",
    "--identity-tier",
    "0",
    "--ban-s",
    "60",
]


def test_every_swarm_flag_reaches_the_settings(tmp_path):
    cfg = load_config(FLAGS + ["--run-dir", str(tmp_path / "run")], env={})
    s = settings_from_config(cfg)
    assert (s.swarm, s.model, s.seed, s.peers, s.host_maddrs, s.client_mode) == (
        "s1",
        "tiny-random",
        7,
        tuple(cfg.peers),
        ("/ip4/127.0.0.1/tcp/0",),
        True,
    )
    assert (s.window, s.net_timeout_s, s.verify_budget_s, s.verify_budget_mb, s.fetch_max) == (3, 8.0, 0.0, 4.0, 5)
    assert (s.pow_difficulty, s.identity_tier, s.ban_s, s.create_identity) == (2, 0, 60.0, True)
    assert s.files == SwarmFiles(
        tmp_path / "run" / KEY_FILENAME,
        tmp_path / "run" / POW_FILENAME,
        tmp_path / "run" / LIBP2P_IDENTITY_FILENAME,
        tmp_path / "run" / REPUTATION_FILE,
    )
    assert verify_config(cfg) == VerifyConfig.from_settings(s)  # the verifier reads the same mapping


def test_a_run_dir_with_state_never_gets_a_new_identity(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    assert not settings_from_config(load_config(["--run-dir", str(tmp_path)], env={})).create_identity


def test_defaults_are_the_node_defaults(tmp_path):
    """SwarmSettings' own defaults (for tests and tools) are the node's: one config, one behaviour."""
    from_node = settings_from_config(load_config(["--run-dir", str(tmp_path)], env={}))
    alone = SwarmSettings(swarm=from_node.swarm, model=from_node.model, files=from_node.files)
    assert {f.name: getattr(alone, f.name) for f in fields(SwarmSettings)} == {
        f.name: getattr(from_node, f.name) for f in fields(SwarmSettings)
    }


def test_an_exchange_keeps_its_files_where_the_settings_say(tmp_path):
    files = SwarmFiles(
        identity_key=tmp_path / "keys" / "me.key",
        pow=tmp_path / "work" / "me.pow",
        p2p_identity=tmp_path / "p2p" / "peer.id",
        reputation=tmp_path / "rep.json",
    )
    (tmp_path / "work").mkdir()
    settings = SwarmSettings(
        swarm="s2",
        model="m",
        files=files,
        pow_difficulty=2,
        identity_tier=1,
        net_timeout_s=6.0,
        verify_budget_s=1.5,
        fetch_max=3,
        peers=("/ip4/127.0.0.1/tcp/1/p2p/12D3KooWx",),
    )
    ex = DhtExchange.create(settings, MIX)
    me = ex.identity
    assert files.identity_key.stat().st_size == 32 and files.pow.read_bytes()  # minted once, where we said
    assert check_pow(me.public_key_bytes, me.pow_nonce, tier_difficulty(2, 1))
    t = ex.transport.config
    assert (t.p2p_identity_file, t.swarm, t.initial_peers, t.fetch_max, t.fetch_timeout_s) == (
        files.p2p_identity,
        "s2",
        list(settings.peers),
        3,
        3.0,
    )
    v = ex.verifier.cfg
    assert (v.swarm, v.budget_s, v.max_age_s, v.pow_difficulty) == ("s2", 1.5, t.record_ttl_s, 2)
    assert DhtExchange.create(settings, MIX).identity.public_key_bytes == me.public_key_bytes  # loaded, not made
