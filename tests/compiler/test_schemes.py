"""Compression configs: built-in schemes, TOML config files, rule matching, errors."""

from __future__ import annotations

import pytest

from unroller.api import load_graph
from unroller.bench.reference import suite_model_path as model_path
from unroller.compiler.schemes import builtin, load_config, resolve
from unroller.compiler.stash import plan_stash
from unroller.errors import ConfigError


def forms(scheme_or_config, stem="unet_like"):
    graph = load_graph(model_path(stem))
    config = (
        scheme_or_config if not isinstance(scheme_or_config, str) else builtin(scheme_or_config)
    )
    return {s.key: [f.label() for f in s.forms] for s in plan_stash(graph, config).entries}


def test_nocompress_keeps_raw_or_lossless_masks_only():
    for labels in forms("nocompress").values():
        assert all(label in ("raw", "bits") for label in labels)


def test_dct_dense_compresses_large_activations_only():
    graph = load_graph(model_path("resnet_like"))
    plan = plan_stash(graph, builtin("dct-dense"))
    for stashed in plan.entries:
        for form in stashed.forms:
            if form.kind == "codec":
                assert form.codec.name == "dct"
                assert min(stashed.type.shape[-2:]) >= 8
    assert any(f.kind == "codec" for s in plan.entries for f in s.forms)


def test_dct_first_compresses_exactly_one_tensor():
    plan = plan_stash(load_graph(model_path("resnet_like")), builtin("dct-first"))
    compressed = [s.key for s in plan.entries if any(f.kind == "codec" for f in s.forms)]
    assert len(compressed) == 1
    first = plan.entries[[s.key for s in plan.entries].index(compressed[0])]
    assert all(
        not any(f.kind == "codec" for f in s.forms)
        for s in plan.entries
        if s.producer < first.producer
    )


def test_a_tensor_read_raw_by_one_reader_is_never_compressed():
    plan = plan_stash(load_graph(model_path("fanout")), builtin("quant"))
    for stashed in plan.entries:
        kinds = {f.kind for f in stashed.forms}
        assert not ("raw" in kinds and len(kinds) > 1), stashed.key


def test_opt_level_zero_disables_everything(tmp_path):
    config = resolve("dct-dense", None, opt_level=0)
    assert all(labels == ["raw"] for labels in forms(config).values())


def test_config_file_rules_later_win(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("""
masks = true
[default]
compressor = "dct"
keep = 2
[[rule]]
op = "batchnorm2d"
compressor = "quant"
bits = 4
[[rule]]
name = "enc1.*"
compressor = "none"
""")
    config = load_config(path)
    plan = plan_stash(load_graph(model_path("unet_like")), config)
    for stashed in plan.entries:
        for node, _saved, form in stashed.readers:
            if node.name.startswith("enc1."):
                assert form.kind in ("raw", "mask")
            elif form.kind == "codec" and node.op.name == "batchnorm2d":
                assert form.codec.name == "quant" and form.codec.kwargs["bits"] == 4


@pytest.mark.parametrize(
    "text, line, col, words",
    [
        ("mask = true\n", 1, 1, "unknown key 'mask'"),
        ('[default]\ncompressor = "dctt"\n', 2, 14, "dctt"),
        ('[default]\ncompressor = "dct"\nkeep = 99\n', 3, 8, "keep"),
        ('[default]\ncompressor = "dct"\nkep = 2\n', 3, 1, "kep"),
        ('[[rule]]\nop = "conv2d"\n', 1, 1, "compressor"),
        (
            '[[rule]]\ncompressor = "quant"\n\n[[rule]]\nop = "conv3d"\ncompressor = "quant"\n',
            5,
            6,
            "conv3d",
        ),
        ('[[rule]]\ncompressor = "quant"\nbits = 3\n', 3, 8, "bits"),
        ('masks = "yes"\n', 1, 9, "masks"),
        ('[default]\ncompressor = "none"\nkeep = 2\n', 3, 1, "keep"),
    ],
)
def test_config_errors_name_the_line(tmp_path, text, line, col, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}:{col}: error: "), message
    assert words in message
    assert message.splitlines()[2].strip().startswith("^"), message


def test_config_syntax_error_is_reported(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[default\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:1:9: error: invalid TOML: "), str(info.value)
