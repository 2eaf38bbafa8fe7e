# The evaluation, in three kinds of job (rloo_workflow.pipeline: evaluate, judge, report):
# - evaluate: one policy ({policy}: base, sft or an estimator) on the held-out problems, its records and
#   figures ({results}/eval/<policy>.jsonl, .json), cached and read by every result that compares it: a
#   change that touches one policy evaluates that policy again, and no other;
# - judge: an LLM judge's verdicts on a trained policy against SFT (evaluate.judge: llm), the judge served
#   once by the job; the verifier needs none (the report computes its win rates);
# - report: base -> SFT -> RL from the records alone, loading no model: results/gsm8k_<estimator>.json.
rule evaluate:
    input:
        # the policy, SFT (tokenizer and KL reference), the reward model (the proxy), the test split
        unpack(chain_inputs("evaluate")),
    output:
        **OUT["evaluate"],
    params:
        cfg=chain_cfg("evaluate"),
        identity=chain_identity("evaluate"),
        args=chain_args("evaluate"),
    conda:
        RLOO_ENV
    log:
        LOG["evaluate"]["log"],
    benchmark:
        LOG["evaluate"]["benchmark"]
    threads: TORCH_THREADS
    resources:
        **cluster_resources("evaluate"),  # its size: the cluster profile's set-resources (slurm/config.yaml)
    shell:
        "rloo evaluate @{params.args} --set threads={threads} --log {log}"


rule judge:
    input:
        unpack(chain_inputs("judge")),
        # the served judge's weights, where they are a local folder
        **LOCAL_INPUTS["judge"],
    output:
        **OUT["judge"],
    params:
        cfg=chain_cfg("judge"),
        identity=chain_identity("judge"),
        args=chain_args("judge"),
    conda:
        RLOO_ENV
    log:
        stage=LOG["judge"]["log"],
        judge=LOG["judge"]["judge_log"],
    benchmark:
        LOG["judge"]["benchmark"]
    threads: 1
    resources:
        **judge_resources(),  # its size: the cluster profile's set-resources (slurm/config.yaml)
    shell:
        "rloo judge @{params.args} --judge-log {log.judge} --log {log.stage}"


rule report:
    input:
        # the records and figures of base, SFT and the trained policy; its folder (metrics.json); the data's
        # manifest; an LLM judge's verdicts where one judges (rloo_workflow.pipeline.input_graph)
        unpack(chain_inputs("report")),
    output:
        result=OUT["report"]["result"],
        policies=report(
            OUT["report"]["policies"],
            caption="../report/policies.rst",
            category="Evaluation",
            subcategory="{estimator}",
            labels={"estimator": "{estimator}", "plot": "accuracy, KL, length"},
        ),
        proxy_vs_judge=report(
            OUT["report"]["proxy_vs_judge"],
            caption="../report/proxy_vs_judge.rst",
            category="Evaluation",
            subcategory="{estimator}",
            labels={"estimator": "{estimator}", "plot": "proxy reward vs judge"},
        ),
    params:
        cfg=chain_cfg("report"),
        identity=chain_identity("report"),
        args=chain_args("report"),
    conda:
        RLOO_ENV
    log:
        LOG["report"]["log"],
    benchmark:
        LOG["report"]["benchmark"]
    threads: 1
    shell:
        "rloo report @{params.args} --log {log}"


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
