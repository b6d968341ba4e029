"""UniformSoup: the mean of all candidates, lambda_i = 1/m (the paper's default; mergekit's "linear")."""

from ..registry import SOUPS
from .method import SoupMethod, indicator_weights


def uniform_weights(scores, trial, config) -> list[float]:
    return indicator_weights(range(len(scores)), len(scores))


SOUPS.add("uniform", SoupMethod(uniform_weights))
