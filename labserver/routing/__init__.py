"""Across replicas: who takes a request, and how many replicas there are. The policies (plain Python) and their
simulations on a virtual clock."""

from .autoscale import Autoscaler, Decision
from .policies import (POLICIES, LeastLoaded, Policy, Pow2, PrefixAware, PrefixHash, RandomChoice, RoundRobin, Route,
                       make_policy, policy_names, register_policy)
from .scaling import ScalingResult, simulate_scaling
from .simulate import ClusterResult, simulate_cluster

__all__ = ["POLICIES", "Autoscaler", "ClusterResult", "Decision", "LeastLoaded", "Policy", "Pow2", "PrefixAware",
           "PrefixHash", "RandomChoice", "RoundRobin", "Route", "ScalingResult", "make_policy", "policy_names",
           "register_policy", "simulate_cluster", "simulate_scaling"]
