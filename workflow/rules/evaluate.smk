rule evaluate:
    input:
        # the reward model (the proxy), the data, base, SFT and the trained policy (rloo.pipeline.input_graph)
        unpack(chain_inputs("evaluate")),
        judge=JUDGE_MODEL,
    output:
        result=OUT["evaluate"]["result"],
        policies=report(
            OUT["evaluate"]["policies"],
            caption="../report/policies.rst",
            category="Evaluation",
            subcategory="{estimator}",
            labels={"estimator": "{estimator}", "plot": "accuracy, KL, length"},
        ),
        proxy_vs_judge=report(
            OUT["evaluate"]["proxy_vs_judge"],
            caption="../report/proxy_vs_judge.rst",
            category="Evaluation",
            subcategory="{estimator}",
            labels={"estimator": "{estimator}", "plot": "proxy reward vs judge"},
        ),
        # every policy's completions, for judging estimators against each other (rule comparison)
        completions=OUT["evaluate"]["completions"],
    params:
        code=code("evaluate"),
        cfg=chain_cfg("evaluate"),
        lineage=chain_lineage("evaluate"),
        data=data_dir,
        plots=lambda wildcards, output: os.path.dirname(output.policies),
        # the trained policy's name in the results: its estimator (a sweep may set rloo.estimator)
        policy=lambda wildcards: job_estimator(wildcards) or job_config(wildcards)["rloo"]["estimator"],
        variant=variant_arg,
    conda:
        RLOO_ENV
    log:
        stage=f"{LOGS}/evaluate_{{estimator}}.log",
        # the output of the judge's server, when the job serves one (evaluate.llm_judge.serve)
        judge=f"{LOGS}/evaluate_{{estimator}}.judge.log",
    benchmark:
        f"{LOGS}/benchmarks/evaluate_{{estimator}}.tsv"
    threads: TORCH_THREADS
    resources:
        # the policies' GPU, and the served judge's beside it
        gpu=1 + JUDGE_GPUS,
        mem_mb=16000,
        runtime=60,
        cpus_per_task=cpus,
    shell:
        "rloo evaluate --job-config {params.cfg} {params.variant} --set threads={threads} "
        "--data {params.data} --base {input.base} --sft {input.sft} --policy {params.policy}={input.policy} "
        "--reward-model {input.reward_model} --out {output.result} --plots {params.plots} "
        "--judge-log {log.judge} --log {log.stage} && "
        "rloo summary {output.result}"


# A mistyped target (results/gsm8k_rlooo.json) names the valid estimators instead of "no rule".
rule unknown_estimator:
    input:
        no_such_estimator,
    output:
        f"{RESULTS}/gsm8k_{{name}}.json",
    wildcard_constraints:
        # not an estimator: "rloo", and "rloo" followed by ".json" when matched inside the path
        name="(?!(?:" + "|".join(ESTIMATORS) + r")(?:\.json)?$)[^/]+",
    conda:
        RLOO_ENV
    log:
        f"{LOGS}/unknown_estimator_{{name}}.log",
    localrule: True
    shell:
        "false"
