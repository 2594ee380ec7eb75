"""The frozen target's FP8 matmuls: dense linears, MoE experts, the routed products' contract,
and the fp32 references the tests hold them to."""
