# The reproduction workflow, run at the repository root; its rules live in workflows/.
#   snakemake --cores 2                                    # smoke scale (default config)
#   snakemake --report results/smoke/report.html           # the HTML report
#   snakemake --configfile workflows/config/paper.yaml -n  # every paper run, listed
include: "workflows/Snakefile"


# An included file's default target does not carry over to the including one.
rule reproduce:
    default_target: True
    input:
        rules.all.input,
