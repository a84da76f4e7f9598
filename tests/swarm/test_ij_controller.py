import json
import math
import random

import pytest

from node.swarm import ij_controller
from node.swarm.ij_controller import (
    CONTROLLER_NAMES,
    EMAController,
    IJController,
    RoundObservation,
    make_ij_controller,
)


def obs(rnd, r=0.5, *, nl=4, ne=4, avail=10, lsf=1.0, esf=1.0, ext_adv=0.8, loc_adv=0.4):
    return RoundObservation(
        round=rnd,
        reward_mean=r,
        num_local=nl,
        num_external=ne,
        external_available=avail,
        local_signal_frac=lsf,
        external_signal_frac=esf,
        external_adv_abs_mean=ext_adv,
        local_adv_abs_mean=loc_adv,
    )


# --------------------------------------------------------------------------- factory / validation


def test_names_and_protocol():
    assert set(CONTROLLER_NAMES) == {"fixed", "ema", "usefulness"} == set(ij_controller._REGISTRY)
    for name in CONTROLLER_NAMES:
        p = make_ij_controller(name, 8, 4)
        assert isinstance(p, IJController)
        assert p.name == name
        assert p.current_j() == 4


@pytest.mark.parametrize(
    "args,kwargs,msg",
    [
        (("nope", 8, 4), {}, "unknown I/J controller"),
        (("ema", 8, 9), {}, "initial_j"),
        (("ema", 8, -1), {}, "initial_j"),
        (("ema", -1, 0), {}, "total"),
        (("ema", 8, 4), {"alpha": -1.0}, "alpha"),
        (("ema", 8, 4), {"alpha": float("nan")}, "alpha"),
        (("ema", 8, 4), {"ema_beta": 1.0}, "ema_beta"),
        (("ema", 8, 4), {"gamma": 0.1}, "unknown parameter"),
        (("fixed", 8, 4), {"alpha": 0.1}, "unknown parameter"),
        (("usefulness", 8, 4), {"j_max": 9}, "j_max"),
        (("usefulness", 8, 4), {"j_min": 5, "j_max": 3}, "j_min"),
        (("usefulness", 8, 4), {"beta": 2}, "beta"),
    ],
)
def test_bad_args(args, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        make_ij_controller(*args, **kwargs)


def test_name_is_case_insensitive():
    assert make_ij_controller(" EMA ", 8, 2).name == "ema"


# --------------------------------------------------------------------------- fixed


def test_fixed_never_changes():
    rng = random.Random(0)
    p = make_ij_controller("fixed", 8, 2)
    for t in range(200):
        p.update(obs(t, rng.random(), ext_adv=rng.random() * 3, loc_adv=rng.random()))
        assert p.current_j() == 2
    assert p.split() == (6, 2)
    q = make_ij_controller("fixed", 8, 2)
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.current_j() == 2


# --------------------------------------------------------------------------- ema


def test_ema_hand_computed():
    p = make_ij_controller("ema", 8, 4, alpha=2.0, ema_beta=0.5)
    p.update(obs(0, 0.5))  # EMA initialised to 0.5, J unchanged
    assert p.j == pytest.approx(4.0) and p.ema == pytest.approx(0.5)
    p.update(obs(1, 0.9))  # d = 0.4 -> J = 4.8 ; ema = 0.7
    assert p.j == pytest.approx(4.8) and p.ema == pytest.approx(0.7)
    assert p.current_j() == 5
    p.update(obs(2, 0.3))  # d = -0.4 -> J = 4.0 ; ema = 0.5
    assert p.j == pytest.approx(4.0) and p.ema == pytest.approx(0.5)
    p.update(obs(3, 0.5))  # d = 0
    assert p.j == pytest.approx(4.0)
    p.update(obs(4, 0.6))  # d = 0.1 -> J = 4.2 ; ema = 0.55
    assert p.j == pytest.approx(4.2) and p.ema == pytest.approx(0.55)
    assert p.current_j() == 4


def test_ema_clips_at_total_and_zero():
    p = make_ij_controller("ema", 8, 4, alpha=10.0, ema_beta=0.5)
    p.update(obs(0, 0.0))
    p.update(obs(1, 1.0))  # 4 + 10*1 = 14 -> 8 ; ema = 0.5
    assert p.j == 8.0 and p.current_j() == 8
    p.update(obs(2, 0.0))  # 8 + 10*(-0.5) = 3 ; ema = 0.25
    assert p.j == pytest.approx(3.0) and p.ema == pytest.approx(0.25)
    p.update(obs(3, -1.0))  # 3 + 10*(-1.25) < 0 -> 0
    assert p.j == 0.0 and p.current_j() == 0


def test_ema_nan_reward_leaves_absorbing_state():
    p = make_ij_controller("ema", 8, 8, alpha=1.0)
    p.update(obs(0, float("nan"), nl=0, ne=8))
    assert p.current_j() == 7
    assert p.ema is None


def test_split_fixed_as_configured_adaptive_keeps_one_local_group():
    assert make_ij_controller("fixed", 8, 8).split() == (0, 8)  # what the configuration says, unclamped
    p = make_ij_controller("ema", 8, 4, alpha=10.0, ema_beta=0.5)
    p.update(obs(0, 0.0))
    p.update(obs(1, 1.0))  # J = 8 = total
    assert p.current_j() == 8 and p.split() == (1, 7)
    p.update(obs(2, 0.0))  # back to 3
    assert p.split() == (5, 3)


def test_ema_round_half_up():
    p = EMAController(8, 2)
    p.j = 2.5
    assert p.current_j() == 3
    p.j = 2.4999
    assert p.current_j() == 2


def test_replayed_rounds_are_ignored():
    p = make_ij_controller("ema", 8, 4, alpha=2.0, ema_beta=0.5)
    p.update(obs(5, 0.5))
    p.update(obs(6, 0.9))
    j = p.j
    p.update(obs(6, 0.0))  # replay of round 6
    p.update(obs(3, 0.0))  # older
    assert p.j == j and p.updates == 2


def test_ema_state_dict_round_trip():
    p = make_ij_controller("ema", 8, 4, alpha=3.0, ema_beta=0.8)
    rs = [0.1, 0.3, 0.2, 0.6, 0.5]
    for t, r in enumerate(rs):
        p.update(obs(t, r))
    sd = json.loads(json.dumps(p.state_dict(), allow_nan=False))
    q = make_ij_controller("ema", 8, 0, alpha=3.0, ema_beta=0.8)
    q.load_state_dict(sd)
    assert q.state_dict() == p.state_dict()
    p.update(obs(5, 0.9))
    q.update(obs(5, 0.9))
    assert q.j == p.j and q.current_j() == p.current_j()
    q.update(obs(5, 0.0))  # last_round restored -> replay ignored
    assert q.j == p.j


def test_load_state_dict_rejects_mismatch():
    p = make_ij_controller("ema", 8, 4)
    with pytest.raises(ValueError, match="not 'ema'"):
        p.load_state_dict(make_ij_controller("fixed", 8, 4).state_dict())
    with pytest.raises(ValueError, match="total"):
        p.load_state_dict(make_ij_controller("ema", 6, 4).state_dict())


# --------------------------------------------------------------------------- usefulness


def test_usefulness_hand_computed():
    p = make_ij_controller("usefulness", 8, 4, beta=0.5, step=0.5)
    # u_loc = 0.4, u_ext = 1.2 -> share 0.75 -> J* = 6 -> J = 4 + 0.5
    p.update(obs(0, 0.5, loc_adv=0.4, ext_adv=1.2))
    assert p.u_loc == pytest.approx(0.4) and p.u_ext == pytest.approx(1.2)
    assert p.last_target == pytest.approx(6.0)
    assert p.j == pytest.approx(4.5) and p.current_j() == 5
    # u_loc = 0.6, u_ext = 0.8 -> J* = 8 * 0.8/1.4 = 4.571428... (within step)
    p.update(obs(1, 0.5, loc_adv=0.8, ext_adv=0.4))
    assert p.u_loc == pytest.approx(0.6) and p.u_ext == pytest.approx(0.8)
    assert p.j == pytest.approx(8 * 0.8 / 1.4)
    assert p.current_j() == 5


def test_usefulness_prior_without_external_measurement():
    p = make_ij_controller("usefulness", 8, 1, beta=0.5, step=10.0)
    p.update(obs(0, 0.5, ne=0, ext_adv=0.0, loc_adv=0.3))  # u_ext := u_loc -> J* = 4
    assert p.u_ext is None and p.j == pytest.approx(4.0)


def test_usefulness_clips_to_j_min_and_j_max():
    p = make_ij_controller("usefulness", 8, 4, beta=0.5, step=0.5)
    for t in range(10):  # local groups carry no signal -> J* = 8 -> clipped to j_max = 7
        p.update(obs(t, 0.5, loc_adv=0.0, ext_adv=1.0))
    assert p.last_target == 7.0 and p.j == 7.0 and p.current_j() == 7
    q = make_ij_controller("usefulness", 8, 4, beta=0.5, step=1.0)
    for t in range(10):  # external useless -> J* = 0 -> clipped to j_min = 1
        q.update(obs(t, 0.5, loc_adv=1.0, ext_adv=0.0))
    assert q.j == 1.0 and q.current_j() == 1
    z = make_ij_controller("usefulness", 8, 4, beta=0.0, step=8.0, j_min=0, j_max=8)
    z.update(obs(0, 0.5, loc_adv=1.0, ext_adv=0.0))
    assert z.current_j() == 0
    z.update(obs(1, 0.5, loc_adv=0.0, ext_adv=0.0))  # both zero -> share 0.5
    assert z.current_j() == 4


def test_usefulness_forgetting_guard():
    p = make_ij_controller("usefulness", 8, 6, beta=0.5, step=0.5, drop_tol=0.1, guard_step=1.0)
    # equal usefulness -> J* = 4: move 6 -> 5.5
    p.update(obs(0, 0.5, loc_adv=0.5, ext_adv=0.5))
    assert p.j == pytest.approx(5.5)
    # reward drops to 0: fast = 0.35, slow = 0.475, gap 0.125 > 0.1 -> J -= 1
    p.update(obs(1, 0.0, loc_adv=0.5, ext_adv=0.5))
    assert p.fast == pytest.approx(0.35) and p.slow == pytest.approx(0.475)
    assert p.guard_active and p.j == pytest.approx(4.5)
    # stays low: fast = 0.245, slow = 0.45125 -> guard again -> 3.5
    p.update(obs(2, 0.0, loc_adv=0.5, ext_adv=0.5))
    assert p.guard_active and p.j == pytest.approx(3.5)


def test_usefulness_small_totals():
    for total in (0, 1, 2):
        p = make_ij_controller("usefulness", total, 0)
        p.update(obs(0, 0.5, loc_adv=0.0, ext_adv=1.0))
        assert 0 <= p.current_j() <= max(total - 1, 0)


def test_usefulness_state_dict_round_trip():
    p = make_ij_controller("usefulness", 8, 4, beta=0.7)
    rng = random.Random(1)
    for t in range(20):
        p.update(obs(t, rng.random(), loc_adv=rng.random(), ext_adv=rng.random()))
    sd = json.loads(json.dumps(p.state_dict(), allow_nan=False))
    q = make_ij_controller("usefulness", 8, 4, beta=0.7)
    q.load_state_dict(sd)
    assert q.state_dict() == p.state_dict()
    for t in range(20, 30):
        o = obs(t, rng.random(), loc_adv=rng.random(), ext_adv=rng.random())
        p.update(o)
        q.update(o)
        assert math.isclose(p.j, q.j) and p.current_j() == q.current_j()


def test_usefulness_local_signal_fraction_and_availability_cap():
    p = make_ij_controller("usefulness", 8, 4, beta=0.5, step=10.0)
    # u_loc = 0.25 * 0.8 = 0.2, u_ext = 0.6 -> share 0.75 -> J* = 6 (avail 10 does not bind)
    p.update(obs(0, 0.5, lsf=0.25, loc_adv=0.8, ext_adv=0.6))
    assert p.u_loc == pytest.approx(0.2) and p.j == pytest.approx(6.0)
    # no local group had signal: u_loc = 0.5*0.2 + 0.5*0 = 0.1 ; avail = 0.5*10 + 0.5*2 = 6
    # u_ext = 0.6 -> share 6/7 -> 8*6/7 = 6.857 -> capped by avail 6
    p.update(obs(1, 0.5, nl=0, lsf=0.0, loc_adv=0.0, ext_adv=0.6, avail=2))
    assert p.u_loc == pytest.approx(0.1) and p.avail == pytest.approx(6.0)
    assert p.last_target == pytest.approx(6.0) and p.j == pytest.approx(6.0)
    # avail = 0.5*6 + 0.5*0 = 3 -> J* = 3
    p.update(obs(2, 0.5, ne=0, lsf=0.0, nl=0, loc_adv=0.0, avail=0))
    assert p.avail == pytest.approx(3.0) and p.j == pytest.approx(3.0)
