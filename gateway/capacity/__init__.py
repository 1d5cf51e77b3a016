"""How many replicas each pool needs, from policies/capacity.py's model: signal.py feeds it what a running gateway
observes (m3gate_pool_desired_replicas, GET /admin/capacity); plan.py feeds it a recorded demand (`m3gate plan`)."""
