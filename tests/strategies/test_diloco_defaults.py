"""diloco's outer momentum when not given is chosen from the inner optimizer (strategies/periodic.py)."""

import torch

from polytrain.strategies.periodic import default_outer_momentum


def test_the_outer_momentum_is_half_over_an_inner_momentum_and_the_papers_otherwise():
    params = [torch.nn.Parameter(torch.zeros(2))]
    chosen = {name: default_outer_momentum(make(params))[0] for name, make in {
        "sgd momentum 0.9": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "rmsprop momentum 0.5": lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.5),
        "plain sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "adam": lambda p: torch.optim.Adam(p, lr=0.1),
        "adamw": lambda p: torch.optim.AdamW(p, lr=0.1),
    }.items()}
    assert chosen == {"sgd momentum 0.9": 0.5, "rmsprop momentum 0.5": 0.5, "plain sgd": 0.9, "adam": 0.9,
                      "adamw": 0.9}
    why = default_outer_momentum(torch.optim.SGD(params, lr=0.1, momentum=0.9))[1]
    assert "inner momentum 0.9" in why
