"""The parts #54–#65 add, each against the record's own line: #54's asymmetric softcap
23·sigmoid((z + 5) / 7.5), and one ConfigError for each bad new switch. (The banks-2026-01 recipe
itself is not built yet: see docs/roadmap.md.)"""

from __future__ import annotations

import re

import pytest
import torch

from speedrun.errors import ConfigError
from speedrun.model.layers import softcap
from speedrun.recipes import load_recipe

BASE = "stages-2025-12"


def test_asymmetric_softcap_is_the_records_line_bit_for_bit():
    z = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 30
    ours = softcap(z, 11.5, "sigmoid", 7.5, 5.0)
    torch.testing.assert_close(ours, 23 * torch.sigmoid((z + 5) / 7.5), rtol=0, atol=0)  # #54
    z16 = z.bfloat16()  # the record caps the bf16 head output
    torch.testing.assert_close(
        softcap(z16, 11.5, "sigmoid", 7.5, 5.0), 23 * torch.sigmoid((z16 + 5) / 7.5), rtol=0, atol=0
    )
    # asymmetric: the range is (0, 23), reached at z = -5 ± ∞, centre 11.5 at z = -5, not 0
    assert softcap(torch.tensor([-5.0]), 11.5, "sigmoid", 7.5, 5.0).item() == 11.5
    # an offset of 0 leaves the older records' op order (z / 7.5, no add)
    plain = softcap(z, 15.0, "sigmoid", 7.5, 0.0)
    torch.testing.assert_close(plain, 30 * torch.sigmoid(z / 7.5), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model.softcap_form=tanh", "model.softcap_offset=5"], "model.softcap_offset"),
        (["model.logit_softcap=0", "model.softcap_offset=5"], "model.softcap_offset"),
    ],
)
def test_a_bad_new_switch_is_one_config_error_naming_it(overrides, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_recipe(BASE, overrides)
