{
  # `nix develop`: Python 3.12 with the C++ runtime that the PyTorch wheels link against, and the
  # project in a virtualenv (.venv) created on first entry. Inside it, `snakemake` and `pytest` run
  # as in README.md. Python packages come from PyPI through pip, as on a plain machine, so that the
  # shell and CI install exactly the same versions.
  #
  # `nix develop .#gpu` (Linux GPU machines): the same with the `gpu` extra and CUDA torch in .venv,
  # plus the CUDA toolkit and the host's NVIDIA driver (see gpuShell).
  #
  # CI cannot fetch nixpkgs: it parses this file and evaluates its outputs against a stub nixpkgs
  # (tests/test_flake.py, tests/fixtures/nix/), which has only the attributes used here.
  description = "VCPO reproduction development shell";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-24.11";

  outputs = { self, nixpkgs }:
    let
      systems = [ "x86_64-linux" "aarch64-linux" ];
      forAllSystems = f: nixpkgs.lib.genAttrs systems f;

      # Snakemake is not taken from nixpkgs: the workflow's rules import vcpo, torch and verl, so
      # snakemake has to run in the venv's interpreter, and pyproject.toml's snakemake>=8 already
      # puts it in .venv/bin at the version CI installs.
      # One .venv for both shells (it is what README, CI and .gitignore know); .venv/.flake-shell
      # records which shell installed it, so entering the other one warns instead of mixing CPU
      # and CUDA torch. It is written last: an interrupted install runs again on the next entry.
      mkProjectShell = { pkgs, name, install, extraPackages ? [ ], extraHook ? "" }:
        pkgs.mkShell {
          packages = [ pkgs.python312 pkgs.git pkgs.gcc ] ++ extraPackages;
          shellHook = ''
            # PyPI wheels (torch, pyarrow, ...) expect libstdc++ and zlib from the host system.
            export LD_LIBRARY_PATH=${pkgs.lib.makeLibraryPath [ pkgs.stdenv.cc.cc.lib pkgs.zlib ]}''${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
            ${extraHook}
            vcpo_venv_ok=1
            if [ -e .venv/pyvenv.cfg ] && ! grep -q '${pkgs.python312}' .venv/pyvenv.cfg; then
              # e.g. README's plain-machine command run with the system Python, or an older nixpkgs.
              echo "flake.nix: .venv was made by another Python than this shell's; remove it to rebuild it" >&2
              vcpo_venv_ok=
            elif [ -e .venv/.flake-shell ] && [ "$(cat .venv/.flake-shell)" != ${name} ]; then
              echo "flake.nix: .venv was set up by the $(cat .venv/.flake-shell) shell; remove it to rebuild it for the ${name} shell" >&2
              vcpo_venv_ok=
            elif [ ! -e .venv/.flake-shell ]; then
              { python3 -m venv .venv && ${install} && echo ${name} > .venv/.flake-shell; } || vcpo_venv_ok=
            fi
            if [ -n "$vcpo_venv_ok" ]; then source .venv/bin/activate; fi
            unset vcpo_venv_ok
          '';
        };

      # CPU: the same commands as README.md and .ci/run. `torch==2.13.0` is the CPU build where a
      # local wheel provides it (these project machines); elsewhere PyPI's Linux x86_64 torch is the
      # CUDA build (several GB). To get the CPU build there, enter the first time with
      #   VCPO_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu nix develop
      # (2.13.0+cpu satisfies `torch==2.13.0`, so the project install keeps it).
      cpuShell = system: mkProjectShell {
        pkgs = nixpkgs.legacyPackages.${system};
        name = "default";
        install = ''.venv/bin/pip install torch==2.13.0 ''${VCPO_TORCH_INDEX_URL:+--index-url "$VCPO_TORCH_INDEX_URL"} && .venv/bin/pip install -e ".[test]"'';
      };

      # GPU. torch is not installed first: the `gpu` extra pins the CUDA torch its vLLM was built
      # with (verl[vllm]==0.9.1: torch==2.11.0), so both are resolved in one pip call.
      # PyPI's CUDA torch wheels carry the CUDA runtime, cuDNN and NCCL (nvidia-* packages) at the
      # versions torch was built against, so nixpkgs' copies are deliberately not put on
      # LD_LIBRARY_PATH, where other versions would shadow them. What the wheels lack:
      #  - the toolkit (nvcc, headers) for kernels compiled at install or run time (FlashInfer's JIT
      #    in vLLM, torch.utils.cpp_extension); its CUDA major version must match torch's;
      #  - the driver's libcuda.so, which only the host has. Nix's glibc does not read the host's
      #    ld.so.cache, so the driver libraries are linked into .venv/nvidia-driver (NixOS keeps
      #    them in /run/opengl-driver/lib); not the whole host directory, whose other libraries
      #    would shadow nixpkgs' ones.
      gpuShell = system:
        let
          # The CUDA toolkit is unfree; legacyPackages does not allow it.
          pkgs = import nixpkgs { inherit system; config.allowUnfree = true; };
          cudatoolkit = pkgs.cudaPackages.cudatoolkit;
        in mkProjectShell {
          inherit pkgs;
          name = "gpu";
          extraPackages = [ cudatoolkit ];
          extraHook = ''
            export CUDA_HOME=${cudatoolkit} CUDA_PATH=${cudatoolkit}
            for dir in /run/opengl-driver/lib /usr/lib/wsl/lib /usr/lib/$(uname -m)-linux-gnu /usr/lib64 /usr/lib; do
              if [ -e "$dir/libcuda.so.1" ]; then
                mkdir -p .venv/nvidia-driver
                for lib in "$dir"/libcuda.so* "$dir"/libnvidia-*.so*; do
                  [ -e "$lib" ] && ln -sf "$lib" .venv/nvidia-driver/
                done
                export LD_LIBRARY_PATH=$PWD/.venv/nvidia-driver:$LD_LIBRARY_PATH
                break
              fi
            done
            [ -e .venv/nvidia-driver/libcuda.so.1 ] || echo "flake.nix: no NVIDIA driver (libcuda.so.1) found; torch will not see a GPU" >&2
          '';
          install = ''.venv/bin/pip install -e ".[gpu,test]"'';
        };
    in
    {
      devShells = forAllSystems (system: {
        default = cpuShell system;
        gpu = gpuShell system;
      });
    };
}
