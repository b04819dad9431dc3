"""One :class:`kvdex.CacheConfig` behind every command's cache options (``kvdex.cli_options``).

Every CacheConfig field is an option of ``kvdex generate``, ``demo``, ``eval``, ``bench`` and
``scorecard``, or explicitly excluded by that command with its reason; the options parse back to the
CacheConfig built directly; ``page_cache`` is a validated CacheConfig field.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import kvdex
from kvdex import cli
from kvdex.bench import cli as bench_cli
from kvdex.cli_options import add_cache_options, cache_config_from_args, option_name
from kvdex.config import CacheConfig
from kvdex.eval import cli as eval_cli
from kvdex.eval.card import cli as card_cli

FIELDS = [f.name for f in dataclasses.fields(CacheConfig)]
# a value of every field, none of them the default, valid together
VALUES = dict(
    budget=512, page_size=32, sink=32, window=64, offload=True, dense_layers=3, prefill_chunk=1024, timing=True
)
VALUES["page_cache"] = 40

# kvdex.Cache's keyword-only arguments that are no CacheConfig field (how the cache runs, not what it
# holds: no command option), with their defaults
CACHE_ONLY = {"step_graphs": True}

# command -> (its arguments besides the cache options, the fields it excludes with their reasons,
#             the fields it sets itself, its own defaults where they differ from CacheConfig's)
COMMANDS = {
    "generate": (["generate", "--prompt", "x"], {}, {}, {}),
    "demo": (["demo"], {}, {}, {"budget": 128}),  # README: `kvdex demo [--budget 128]`
    "eval": (["eval", "recall", "--model", "m"], eval_cli.CACHE_EXCLUDED, {"budget": 512}, {}),
    # bench: the offloaded methods of --storages device,offload; README's bench line relies on budget 2048
    "bench": (["bench"], bench_cli.CACHE_EXCLUDED, {"offload": True}, {"budget": 2048}),
    "scorecard": (["scorecard"], card_cli.CACHE_EXCLUDED, {"budget": 512}, {}),
}


def _options(excluded: dict) -> list[str]:
    out = []
    for name in FIELDS:
        if name in excluded:
            continue
        value = VALUES[name]
        out += [option_name(name)] if value is True else [option_name(name), str(value)]
    return out


@pytest.fixture(scope="module")
def parser():
    return cli.build_parser()


def test_every_field_has_a_help_text_and_every_field_is_a_cache_argument():
    for f in dataclasses.fields(CacheConfig):
        assert f.metadata.get("help"), f"CacheConfig.{f.name} has no help text"
        assert f.name in VALUES and VALUES[f.name] != f.default, f"add a non-default value of {f.name} to VALUES"
    params = inspect.signature(kvdex.Cache.__init__).parameters
    keyword_only = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert keyword_only == set(FIELDS) - {"budget"} | set(CACHE_ONLY) and "budget" in params
    for name, default in CACHE_ONLY.items():  # kvdex.Cache's own switches, no CacheConfig field
        assert params[name].default == default, name
    for name in keyword_only - set(CACHE_ONLY):  # kvdex.Cache's defaults are CacheConfig's
        assert params[name].default == CacheConfig.__dataclass_fields__[name].default, name


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_is_an_option_or_excluded_with_a_reason(parser, command):
    argv, excluded, given, _ = COMMANDS[command]
    args = parser.parse_args(argv)
    added = set(args.cache_options)
    assert added | set(excluded) == set(FIELDS) and not added & set(excluded), command
    assert all(isinstance(why, str) and len(why) > 10 for why in excluded.values())
    assert set(given) <= set(excluded), "a command sets only the fields it has no option for"


@pytest.mark.parametrize("command", COMMANDS)
def test_parsed_options_give_the_config_built_directly(parser, command):
    argv, excluded, given, own_defaults = COMMANDS[command]
    args = parser.parse_args([*argv, *_options(excluded)])
    expected = CacheConfig(**{name: VALUES[name] for name in FIELDS if name not in excluded}, **given)
    assert cache_config_from_args(args, **given) == expected
    defaults = parser.parse_args(argv)  # no options: CacheConfig's defaults, or the command's own
    assert cache_config_from_args(defaults, **given) == CacheConfig(**{**own_defaults, **given})


def test_bench_and_scorecard_configs_carry_the_parsed_sizes(parser):
    argv, excluded, _, _ = COMMANDS["bench"]
    bench = bench_cli.config_from_args(parser.parse_args([*argv, *_options(excluded)]))
    for name in set(FIELDS) - set(excluded):
        assert getattr(bench, name) == VALUES[name], name
    argv, excluded, given, _ = COMMANDS["scorecard"]
    card = card_cli.config_from_args(parser.parse_args([*argv, *_options(excluded)]))
    direct = CacheConfig(**{name: VALUES[name] for name in FIELDS if name not in excluded}, **given)
    assert card.cache_config(given["budget"]) == direct


def test_bad_sizes_fail_at_the_command_line(capsys):
    assert cli.main(["generate", "--prompt", "x", "--page-size", "24"]) == 2
    assert "page_size must be a power of two" in capsys.readouterr().err
    assert cli.main(["generate", "--prompt", "x", "--page-cache", "8"]) == 2  # without --offload
    assert "page_cache=8 keeps offloaded pages on the device" in capsys.readouterr().err
    assert cli.main(["bench", "--device", "cpu", "--shape", "tiny", "--storages", "device", "--page-cache", "8"]) == 2
    assert "add offload to --storages" in capsys.readouterr().err


def test_add_cache_options_needs_a_reason_per_excluded_field():
    import argparse

    with pytest.raises(ValueError, match="not a CacheConfig field"):
        add_cache_options(argparse.ArgumentParser(), exclude={"pagesize": "typo"})
    with pytest.raises(ValueError, match="say why"):
        add_cache_options(argparse.ArgumentParser(), exclude={"timing": ""})
    with pytest.raises(ValueError, match="without add_cache_options"):
        cache_config_from_args(argparse.Namespace(budget=64))


def test_page_cache_is_a_validated_config_field(llama):
    assert CacheConfig(offload=True, page_cache=8).page_cache == 8
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="page_cache must be an int >= 0"):
            CacheConfig(offload=True, page_cache=bad)
    with pytest.raises(ValueError, match="pass offload=True, or page_cache=0"):
        CacheConfig(page_cache=8)
    cache = kvdex.Cache(llama[0], "quest", 96, offload=True, page_cache=3)
    assert cache.page_cache == cache.config.page_cache == 3
    with pytest.raises(ValueError, match="pass offload=True"):
        kvdex.Cache(llama[0], "quest", 96, page_cache=3)


def test_fork_carries_page_cache_in_its_config(llama):
    """The demo's path: a device prefill forked into offloaded, page-cached caches (and their forks)."""
    import torch

    from kvdex import cache_kwargs

    model = llama[0]
    ids = torch.randint(0, model.config.vocab_size, (1, 120), generator=torch.Generator().manual_seed(0))
    src = kvdex.Cache(model, "full", 96, dense_layers=1)
    with torch.no_grad():
        model(ids, **cache_kwargs(src))
    fork = src.fork(policy="quest", offload=True, page_cache=3)
    assert fork.config == CacheConfig(budget=96, dense_layers=1, offload=True, page_cache=3)
    assert fork.layers[1].store.page_cache == 3 and fork.layers[0].store.page_cache == 0  # layer 0 is dense
    with pytest.raises(ValueError, match="page_cache=3 keeps offloaded pages on the device"):
        fork.fork(offload=False)
    assert fork.fork(offload=False, page_cache=0).config == CacheConfig(budget=96, dense_layers=1)
