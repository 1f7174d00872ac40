from .policies import POLICY_NAMES, Policy, get_policy

__all__ = ["POLICY_NAMES", "Policy", "get_policy"]
