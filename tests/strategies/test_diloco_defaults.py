"""diloco's outer momentum when not given is chosen from the inner optimizer (strategies/periodic.py)."""

import torch

from polytrain.strategies.periodic import default_outer_momentum


def test_the_outer_momentum_is_one_minus_the_outer_lr_over_an_inner_momentum_and_the_papers_otherwise():
    params = [torch.nn.Parameter(torch.zeros(2))]
    chosen = {name: default_outer_momentum(make(params))[0] for name, make in {
        "sgd momentum 0.9": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "rmsprop momentum 0.5": lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.5),
        "plain sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "adam": lambda p: torch.optim.Adam(p, lr=0.1),
        "adamw": lambda p: torch.optim.AdamW(p, lr=0.1),
    }.items()}
    # over an inner momentum: 1 - outer lr (0.7 by default), an outer step's long-run gain lr / (1 - m) = 1
    assert chosen == {"sgd momentum 0.9": 0.3, "rmsprop momentum 0.5": 0.3, "plain sgd": 0.9, "adam": 0.9,
                      "adamw": 0.9}
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    assert "inner momentum 0.9" in default_outer_momentum(sgd)[1]
    assert default_outer_momentum(sgd, outer_lr=0.5)[0] == 0.5
    assert default_outer_momentum(sgd, outer_lr=1.2)[0] == 0.0
