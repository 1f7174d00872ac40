# session 14, call 4 (x2), the device command as given (one line, split here):
bash benchmarks/gpu/setup_env.sh > $OUT/setup.txt 2>&1; source benchmarks/gpu/common.sh; checkpoint 0.6b >/dev/null 2>&1
export D=20 T=200 W=8; S=benchmarks/gpu/run_serving.sh
(bash $S rates 0.6b voxserve@0 90,94 vx_06b_low >/dev/null 2>&1 &)
P='--param tts:scheduler_chunk_schedule=2,2,4,8,16,25' bash $S rates 0.6b concurrent@1 72,76 cc_06b_low >/dev/null 2>&1
