"""Deployment material: shipped scenarios (`scenarios/`) and, with the cluster issue, the Ray
launch code and configs for local and multi-node clusters.
"""
