"""Wiring file validation: every problem named precisely, valid files frozen."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from orchestrrl import errors, wiring
from orchestrrl.model import Role, Wiring

pytestmark = pytest.mark.unit

SMALL = """
[cluster]
name = "small"
controller = "127.0.0.1:50051"

[[ocs]]
name = "ocs0"
address = "127.0.0.1:50061"
ports = 8

[[pod]]
name = "t0"
[[pod]]
name = "g0"

[[tor]]
name = "tor-t0"
pod = "t0"
uplinks = [
  { port = "up0", ocs = "ocs0", ocs_port = 1 },
  { port = "up1", ocs = "ocs0", ocs_port = 2 },
]
[[tor]]
name = "tor-g0"
pod = "g0"
uplinks = [{ port = "up0", ocs = "ocs0", ocs_port = 3 }]

[[node]]
name = "t0-n0"
pod = "t0"
role = "train"
agent = "127.0.0.1:50101"
gpus = 8
nics = [{ name = "eth0", tor = "tor-t0", tor_port = "p0" }]
[[node]]
name = "g0-n0"
pod = "g0"
role = "gen"
agent = "127.0.0.1:50102"
gpus = 8
nics = [{ name = "eth0", tor = "tor-g0", tor_port = "p0", gbps = 200 }]
"""


def problems_of(text: str) -> list[str]:
    with pytest.raises(wiring.WiringError) as info:
        wiring.parse(text, "test.toml")
    return info.value.problems


def one_problem(text: str) -> str:
    found = problems_of(text)
    assert len(found) == 1, found
    return found[0]


def test_small_wiring_is_valid_and_frozen() -> None:
    w = wiring.parse(SMALL)
    assert w.cluster == "small"
    assert [p.name for p in w.pods] == ["t0", "g0"]
    assert w.pod("t0").role is Role.TRAIN
    assert w.pod("g0").role is Role.GEN
    assert w.ocs("ocs0").switching_time_s == pytest.approx(0.010)  # default 10 ms
    assert w.node("t0-n0").nics[0].gbps == 400.0  # default
    assert w.node("g0-n0").nics[0].gbps == 200.0
    assert w.port_owner("ocs0", 3) == "g0"
    assert w.port_owner("ocs0", 4) is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.cluster = "x"  # type: ignore[misc]


def test_example_wiring_matches_the_issue(example_wiring: Wiring) -> None:
    w = example_wiring
    assert len(w.pods) == 4 and len(w.nodes) == 8
    assert w.pods_with_role(Role.TRAIN) == ("train0", "train1")
    assert w.pods_with_role(Role.GEN) == ("gen0", "gen1")
    assert [(o.name, o.ports) for o in w.ocses] == [("ocs0", 32)]
    assert all(n.gpus == 8 and len(n.nics) == 8 for n in w.nodes)


def test_examples_file_is_the_embedded_default() -> None:
    examples = Path(__file__).parents[2] / "examples" / "local-8node.toml"
    assert examples.read_text() == wiring.default_wiring_path().read_text()


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "ocs_port = 2 },",
            "ocs_port = 1 },",
            r"tor 'tor-t0'\.uplinks\[1\]\.ocs_port = 1: port 1 of "
            r"OCS 'ocs0' is already cabled to tor 'tor-t0'\.uplinks\[0\]",
        ),
        ("ocs_port = 3 }]", "ocs_port = 9 }]", r"ocs_port = 9: an integer from 1 to 8"),
        (
            'tor = "tor-g0", tor_port',
            'tor = "tor-x", tor_port',
            r"nics\[0\]\.tor = 'tor-x': no such ToR; defined ToRs: tor-t0, tor-g0",
        ),
        (
            'tor = "tor-g0", tor_port',
            'tor = "tor-t0", tor_port',
            r"ToR is in pod 't0' but the node is in pod 'g0'",
        ),
        ('role = "gen"', 'role = "rollout"', r"role = 'rollout': expected 'train' or 'gen'"),
        ("ports = 8", "ports = 1", r"ocs 'ocs0'\.ports = 1: an integer from 2 to 4096"),
        (
            'gpus = 8\nnics = [{ name = "eth0", tor = "tor-g0"',
            'gpus = -1\nnics = [{ name = "eth0", tor = "tor-g0"',
            r"gpus = -1: an integer from 0 to 64",
        ),
        (
            'agent = "127.0.0.1:50102"',
            'agent = "127.0.0.1:50101"',
            r"agent = '127.0.0.1:50101': address already used by node 't0-n0'",
        ),
        ('agent = "127.0.0.1:50102"', 'agent = "localhost"', r"expected HOST:PORT"),
        (
            'ocs = "ocs0", ocs_port = 3',
            'ocs = "ocs7", ocs_port = 3',
            r"uplinks\[0\]\.ocs = 'ocs7': no such OCS; defined OCSes: ocs0",
        ),
        ('pod = "g0"\nrole', 'pod = "g9"\nrole', r"pod = 'g9': no such pod; defined pods: t0, g0"),
        ('name = "g0-n0"', 'name = "t0-n0"', r"node: name 't0-n0' is defined 2 times"),
        ("gbps = 200", "gbps = 0", r"gbps = 0: a number greater than 0.0"),
        (
            "ports = 8",
            "ports = 8\nspeed = 1",
            r"ocs\[0\]\.speed: unknown key \(allowed: address, driver, "
            r"name, netconf, ports, switching_time_ms\)",
        ),
        ('name = "small"', 'name = "bad name!"', r"cluster\.name = 'bad name!': 1-63 characters"),
    ],
)
def test_each_problem_is_named_precisely(old: str, new: str, expected: str) -> None:
    assert old in SMALL, old
    found = problems_of(SMALL.replace(old, new, 1))
    assert any(re.search(expected, p) for p in found), found


def test_duplicate_tor_port_between_nics() -> None:
    text = SMALL.replace(
        'nics = [{ name = "eth0", tor = "tor-t0", tor_port = "p0" }]',
        'nics = [{ name = "eth0", tor = "tor-t0", tor_port = "p0" }, '
        '{ name = "eth1", tor = "tor-t0", tor_port = "p0" }]',
    )
    assert "port 'p0' of ToR 'tor-t0' is already used by node 't0-n0'.nics[0]" in one_problem(text)


def test_mixed_roles_in_one_pod() -> None:
    text = SMALL.replace('pod = "g0"\nrole = "gen"', 'pod = "t0"\nrole = "gen"').replace(
        'tor = "tor-g0", tor_port = "p0"', 'tor = "tor-t0", tor_port = "p9"'
    )
    found = problems_of(text)
    assert any("nodes have different roles" in p for p in found), found


def test_all_problems_reported_at_once() -> None:
    text = SMALL.replace('role = "gen"', 'role = "x"').replace("ports = 8", "ports = 0")
    assert len(problems_of(text)) >= 2


def test_not_toml_and_empty() -> None:
    assert "not valid TOML" in one_problem("[[node]\nname=")
    assert any("no nodes" in p for p in problems_of(""))


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(errors.InvalidArgument, match=r"nope\.toml"):
        wiring.load(tmp_path / "nope.toml")


def test_error_message_lists_source_and_count() -> None:
    with pytest.raises(wiring.WiringError) as info:
        wiring.parse(SMALL.replace('role = "gen"', 'role = "x"'), "cluster.toml")
    assert str(info.value).startswith("cluster.toml: 1 problem(s) in the wiring:")


def test_to_dict_is_the_normalised_wiring() -> None:
    d = wiring.to_dict(wiring.parse(SMALL))
    assert d["ocs"][0]["switching_time_ms"] == 10.0
    assert d["pod"][0] == {"name": "t0", "role": "train", "nodes": ["t0-n0"], "tors": ["tor-t0"]}
    assert d["node"][0]["nics"][0]["gbps"] == 400.0


def test_to_toml_round_trips(example_wiring: Wiring) -> None:
    from sim_backends.synthetic import synthetic_wiring

    for w in (example_wiring, wiring.parse(SMALL), synthetic_wiring(64, max_ocs_ports=64)):
        assert wiring.parse(wiring.to_toml(w), w.source) == w


ROUTED = (
    SMALL.replace('[[pod]]\nname = "t0"', '[[pod]]\nname = "t0"\nprefix = "10.0.1.0/24"')
    .replace('[[pod]]\nname = "g0"', '[[pod]]\nname = "g0"\nprefix = "10.0.2.0/24"')
    .replace(
        '{ port = "up0", ocs = "ocs0", ocs_port = 1 }',
        '{ port = "up0", ocs = "ocs0", ocs_port = 1, device = "eth-up0", ip = "172.16.0.1" }',
    )
    .replace('name = "tor-t0"\npod = "t0"', 'name = "tor-t0"\npod = "t0"\nnetns = "orl-tor-t0"')
)


def test_routing_fields() -> None:
    w = wiring.parse(ROUTED)
    assert w.pod("t0").prefix == "10.0.1.0/24"
    tor = w.tor("tor-t0")
    assert tor.netns == "orl-tor-t0"
    assert (tor.uplinks[0].interface, tor.uplinks[0].ip) == ("eth-up0", "172.16.0.1")
    assert tor.uplinks[1].interface == "up1"  # device defaults to the port name
    assert wiring.parse(wiring.to_toml(w)) == w


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('prefix = "10.0.2.0/24"', 'prefix = "10.0.1.128/25"', "overlaps"),
        ('prefix = "10.0.2.0/24"', 'prefix = "10.0.2.1/24"', "without host bits"),
        ('ip = "172.16.0.1"', 'ip = "172.16.0.300"', "an IP address"),
        ('device = "eth-up0"', 'device = "a/b"', "a Linux interface name"),
    ],
)
def test_routing_field_problems(old: str, new: str, expected: str) -> None:
    found = problems_of(ROUTED.replace(old, new))
    assert any(expected in p for p in found), found


# -- one mistake, one problem (issue 14) -----------------------------------------------

EXAMPLE = wiring.default_wiring_path().read_text()
TOR_GEN1 = re.compile(r'\[\[tor\]\]\nname = "tor-gen1"\npod = "gen1"\nuplinks = \[.*?\n\]\n', re.S)


def test_a_tor_with_zero_uplinks_is_one_problem() -> None:
    for uplinks in ("uplinks = []\n", ""):
        text = TOR_GEN1.sub(f'[[tor]]\nname = "tor-gen1"\npod = "gen1"\n{uplinks}', EXAMPLE)
        problem = one_problem(text)
        assert problem.startswith("tor 'tor-gen1'.uplinks: none; a ToR needs at least one uplink")


def test_a_pod_without_a_tor_is_named_once_not_at_every_nic() -> None:
    text = TOR_GEN1.sub("", EXAMPLE)
    assert "tor-gen1" not in text.split("[[node]]")[0]
    problem = one_problem(text)  # not 16 "no such ToR" problems, one per NIC of its nodes
    assert problem.startswith("pod 'gen1': has no ToR")


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("ports = 32", 'ports = "32"', "ocs 'ocs0'.ports = '32': an integer from 2 to 4096, "),
        (
            "switching_time_ms = 10.0",
            'switching_time_ms = "10"',
            "ocs 'ocs0'.switching_time_ms = '10': a number greater than 0.0",
        ),
        ("gpus = 8", 'gpus = "8"', "node 'train0-n0'.gpus = '8': an integer from 0 to 64, "),
        ("ocs_port = 1 }", 'ocs_port = "1" }', ".uplinks[0].ocs_port = '1': an integer from 1"),
    ],
)
def test_a_string_where_a_number_belongs_is_one_problem(old: str, new: str, expected: str) -> None:
    # an OCS with a bad field is still defined: its 32 uplinks are not "no such OCS" too
    problem = one_problem(EXAMPLE.replace(old, new, 1))
    assert problem.startswith(expected) or expected in problem, problem
    assert problem.endswith("not a string: write it without quotes")


def test_a_huge_value_is_shown_cut() -> None:
    text = SMALL.replace('name = "small"', f'name = "{"x" * 1_000_000}"')
    problem = one_problem(text)
    assert len(problem) < 600 and "(1000000 characters)" in problem


def test_diff_names_what_a_reload_changes() -> None:
    old = wiring.parse(EXAMPLE)
    assert wiring.diff(old, old) == []
    cut = EXAMPLE.rindex("[[node]]")
    fewer = wiring.parse(EXAMPLE[:cut])
    removed, pod = old.nodes[-1].name, old.nodes[-1].pod  # its pod lists one node less
    assert wiring.diff(old, fewer) == [f"pod {pod!r} changed", f"node {removed!r} removed"]
    assert wiring.diff(fewer, old) == [f"pod {pod!r} changed", f"node {removed!r} added"]
    moved = wiring.parse(
        EXAMPLE.replace('controller = "127.0.0.1:50051"', 'controller = "127.0.0.1:50052"')
    )
    assert wiring.diff(old, moved) == ["controller '127.0.0.1:50051' -> '127.0.0.1:50052'"]
    slower = wiring.parse(EXAMPLE.replace("switching_time_ms = 10.0", "switching_time_ms = 20.0"))
    assert wiring.diff(old, slower) == ["ocs 'ocs0' changed"]


# -- files that are not wirings at all: each refused by one bounded message --


def test_size_is_capped_whatever_the_file(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    big.write_text(SMALL + "#" * 100)
    with pytest.raises(wiring.WiringError, match=r"larger than 64 bytes") as info:
        wiring.load(big, max_bytes=64)
    assert info.value.source == str(big)
    assert wiring.load(big, max_bytes=len(SMALL) + 100).cluster == "small"  # at the cap: read
    endless = r"(?s)/dev/zero: 1 problem.*larger than 4,096 bytes"
    with pytest.raises(wiring.WiringError, match=endless):
        wiring.load("/dev/zero", max_bytes=4096)  # an endless stream: 4097 bytes read


def test_not_utf8_names_line_column_and_byte(tmp_path: Path) -> None:
    f = tmp_path / "bin.toml"
    f.write_bytes(b'[cluster]\nname = "\xffx"\n')
    with pytest.raises(wiring.WiringError) as info:
        wiring.load(f)
    assert info.value.problems == [
        "not UTF-8 text at line 2, column 9 (byte 18: 0xff): a wiring file is TOML, "
        "written in UTF-8"
    ]
    assert str(info.value).startswith(f"{f}: 1 problem(s)")


@pytest.mark.parametrize("opening", ["a = " + "[" * 5000, "a = " + "{b = " * 5000])
def test_deep_nesting_is_refused_before_the_parser_recurses(opening: str) -> None:
    text = "\n\n" + opening
    problem = one_problem(text)
    column = 4 + wiring.MAX_NESTING * (1 if "[" in opening else 5) + 1
    assert problem == (
        f"not valid TOML: arrays or inline tables nested more than {wiring.MAX_NESTING} "
        f"deep (at line 3, column {column}); a wiring needs 2"
    )


def test_brackets_in_strings_and_comments_do_not_nest() -> None:
    noise = "[" * 200 + "{" * 200
    text = SMALL.replace(
        '[cluster]\nname = "small"',
        f'# {noise}\n[cluster]\nname = "small" # {noise}\n'
        f"[notes]\nnote = '''{noise}'''\nb = \"{noise}\\\"\"\nc = '{noise}'\n"
        f'd = """{noise}"""\n',
    )
    assert any("unknown" in p for p in problems_of(text))  # reached the validation
    assert wiring._too_deep(text, wiring.MAX_NESTING) is None


def test_twenty_thousand_problems_give_a_bounded_message() -> None:
    text = "".join(f"x{i} = {i}\n" for i in range(20_000)) + SMALL  # 20,000 unknown sections
    with pytest.raises(wiring.WiringError) as info:
        wiring.parse(text, "many.toml")
    message = str(info.value)
    assert len(info.value.problems) == 20_000  # every problem kept for a program
    assert len(message.encode()) <= errors.MAX_MESSAGE_BYTES
    assert message.startswith("many.toml: 20000 problem(s) in the wiring:\n")
    assert message.count("\n  - ") == errors.MAX_LISTED + 1
    assert message.endswith(f"\n  - and {20_000 - errors.MAX_LISTED} more")


def test_a_long_problem_is_cut_to_the_rpc_bound() -> None:
    err = wiring.WiringError("x.toml", ["a" * 10_000])
    assert len(str(err).encode()) <= errors.MAX_MESSAGE_BYTES
    assert str(err).startswith("x.toml: 1 problem(s)") and "bytes cut" in str(err)
