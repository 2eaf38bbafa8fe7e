# The starting model as one local folder, {models}/base (rloo_workflow/stages/base.py): the embedded tiny model
# (built from the training texts), a local folder, a hub snapshot, or a dequantised GGUF file. Every
# later stage reads this folder; a changed source reruns everything below it, and nothing else.
rule base:
    input:
        unpack(chain_inputs("base")),
        # model.name_or_path / model.tokenizer when they are local folders; the GGUF file itself
        **LOCAL_INPUTS["base"],
    output:
        model=directory(OUT["base"]["model"]),
    params:
        cfg=chain_cfg("base"),
        identity=chain_identity("base"),
        args=chain_args("base"),
    conda:
        RLOO_ENV
    log:
        LOG["base"]["log"],
    benchmark:
        LOG["base"]["benchmark"]
    threads: 1
    shell:
        "rloo base @{params.args} --log {log}"
