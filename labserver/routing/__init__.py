"""Across replicas: who takes a request. The policies (plain Python) and their simulation on a virtual clock."""

from .policies import (POLICIES, LeastLoaded, Policy, Pow2, PrefixAware, PrefixHash, RandomChoice, RoundRobin, Route,
                       make_policy, policy_names, register_policy)
from .simulate import ClusterResult, simulate_cluster

__all__ = ["POLICIES", "ClusterResult", "LeastLoaded", "Policy", "Pow2", "PrefixAware", "PrefixHash", "RandomChoice",
           "RoundRobin", "Route", "make_policy", "policy_names", "register_policy", "simulate_cluster"]
