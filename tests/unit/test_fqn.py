"""``cfsdp._fqn.full_name``: a tensor's FQN in the whole model from the module that holds
it, which is all a face has when it is handed a submodule (a layer wrapped or sharded on its
own); the errors that name a parameter use it."""

import pytest
import torch.nn as nn

from cfsdp._fqn import FSDP_WRAPPED_MODULE, full_name

pytestmark = pytest.mark.no_core


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(2, 2)


def test_from_a_submodule_the_model_s_fqn():
    m = Model()
    assert full_name(m.layers[2].lin, "weight") == "layers.2.lin.weight"
    assert full_name(m.layers[1], "lin.bias") == "layers.1.lin.bias"
    assert full_name(m.head, "bias") == "head.bias"
    assert full_name(m, "head.bias") == "head.bias"


def test_a_module_alone_names_relative_to_itself():
    lin = nn.Linear(2, 2)
    assert full_name(lin, "weight") == "weight"


def test_wrapper_prefixes_are_cleaned():
    m = Model()

    class Wrapper(nn.Module):  # stands for a wrapper: its child under the wrapper's name
        def __init__(self, inner):
            super().__init__()
            self.add_module(FSDP_WRAPPED_MODULE, inner)

    inner = m.layers[0]
    m.layers[0] = Wrapper(inner)
    assert full_name(inner.lin, "weight") == "layers.0.lin.weight"


def test_a_shared_module_stops_the_walk():
    shared = Block()
    a, b = nn.Sequential(shared), nn.Sequential(nn.Linear(2, 2), shared)
    assert full_name(shared.lin, "weight") == "lin.weight"  # 0.lin.weight or 1.lin.weight
    assert len(a) == len(b) - 1


def test_known_name_kept_when_the_module_left_its_tree():
    m = Model()
    block = m.layers[1]
    assert full_name(block, "lin.weight", known="layers.1.lin.weight") == "layers.1.lin.weight"
    del m.layers[1]
    assert full_name(block, "lin.weight", known="layers.1.lin.weight") == "layers.1.lin.weight"
    assert full_name(block, "lin.weight", known="lin.weight") == "lin.weight"
