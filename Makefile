# passage: the two commands are `make demo` and `make test` (see README.md).
SHELL := /bin/bash
BUILD := build
GO ?= go
# -trimpath in every go command make runs: without it a compiled package embeds its
# directory, so the build cache's entries for this repository's packages (and vet's)
# hold only for a clone at the same path; CI's clone is new every run. With it a warm
# cache serves any clone: `go test -race -run NONE ./...` in a fresh clone took 60 s
# without it, 30 s with it, as in the warm one (7 Dec).
export GOFLAGS := $(strip -trimpath $(GOFLAGS))

.PHONY: all deps build test unit qemu-test cluster-bin cluster-test storm-bench qemu-bench demo kernel initramfs ipxe uki bench fuzz clean

all: build

# deps installs what the commands need from Debian's archive when it is missing, and
# fetches passage-dra's glibc base (.debs) into $(BUILD)/images/debs: the tests that use
# them read them there and download nothing.
deps:
	@BUILD=$(abspath $(BUILD)) bash image/deps.sh

# The build passage names (passage version, the manifest) is stamped from git by
# image/buildstamp.sh, as the image's is: the same revision whatever -buildvcs says.
# CGO_ENABLED=0, as in the image: a static binary starts without the dynamic loader,
# libc and cgo's thread set-up (about a fifth of `passage help`'s CPU time, bench row O2),
# and passage uses nothing from libc (names and addresses resolve in Go).
build:
	@mkdir -p $(BUILD)
	CGO_ENABLED=0 $(GO) build -ldflags="$$(bash image/buildstamp.sh)" -o $(BUILD)/passage ./cmd/passage

# KERNEL chooses the image's kernel: 6.12 (Debian 13's, the default: it programs the
# plan's pci=config_acs= itself, which a locked-down Secure Boot node needs), 6.1
# (Debian 12's), or a linux-image-<version>-amd64 package name. Each kernel's image is
# built in its own directory, IMAGE; the u-root part is shared.
KERNEL ?= 6.12
IMAGE := $(BUILD)/linux-$(KERNEL)
# The QEMU suite boots the default kernel, and 6.1 for the scenarios that must hold on it.
QEMU_KERNELS := 6.12 6.1

kernel: deps
	@KERNEL_CACHE=$(BUILD) bash image/kernel.sh $(IMAGE)/kernel $(KERNEL)

initramfs: kernel
	@bash image/initramfs.sh $(IMAGE) $(BUILD)

ipxe: initramfs
	@bash image/ipxe.sh $(IMAGE)

# uki writes $(IMAGE)/netboot/passage.efi, the kernel, initramfs and command line as one
# unified kernel image signed for UEFI Secure Boot, and the boot.ipxe that chains it.
# UKI_KEY/UKI_CERT: the operator's db signing key (never one shipped in an image).
# PLAN: a saved plan (passage plan -o) of a reference node of the SKU: its
# pci=config_acs= and passage.plan=sha256:<digest> go into the signed command line, so a
# locked-down kernel (6.11+) programs the ACS itself and passage verifies it. The whole
# line must be shorter than the kernel keeps (2046 bytes on x86, so the boot can tell it
# whole): passage cmdline --base and uki.sh refuse a longer one before anything is signed.
UKI_CMDLINE ?= console=ttyS0,115200 intel_iommu=on panic=-1 rdinit=/bbin/passage passage.profile=b300 passage.handoff=switch_root passage.root=LABEL=root
uki: initramfs build
	@test -n "$(UKI_KEY)" -a -n "$(UKI_CERT)" || { echo "make uki: set UKI_KEY= and UKI_CERT= (the db key that signs the image)"; exit 2; }
	@cmdline="$(UKI_CMDLINE)"; \
	if [ -n "$(PLAN)" ]; then plan=$$($(BUILD)/passage cmdline --plan "$(PLAN)" --base "$$cmdline") || exit 1; cmdline="$${cmdline:+$$cmdline }$$plan"; echo "uki: plan $(PLAN): $$plan"; fi; \
	bash image/uki.sh $(IMAGE)/netboot $(IMAGE)/kernel/vmlinuz $(IMAGE)/initramfs.cpio.gz "$$cmdline" "$(UKI_KEY)" "$(UKI_CERT)"

# unit checks formatting, runs vet, staticcheck and the race-enabled unit tests (synthetic
# trees, lspci oracle, TPM simulator). staticcheck runs from its own module at a pinned
# version, so it adds nothing to passage's dependencies. kube/, everything that runs on
# Kubernetes, is a module of its own (the Kubernetes libraries stay out of the initramfs
# binary): it gets the same checks. kube/kubevirthook, the KubeVirt hook sidecar, is one
# more. Its go.mod moves KubeVirt v1.9.0's k8s.io pins (v0.34.2) to kube/'s v0.37.2, grpc
# and protobuf with them, so every module both compile is at one version (kube/harness
# TestHookSharesKube): after kube/, its vet and race tests compile 58 packages of their
# own (KubeVirt's 45 among them) rather than 204, the rest are kube/'s build-cache
# entries. Warm, seconds.
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2
# The three modules' checks one after the other: side by side (make -j3) the race tests
# of cmd/passage and pci took twice as long and the phase 671 s instead of 589 s (7 Dec,
# clean clones); what the phase leaves idle goes to make test's builds beside it.
unit: deps
	@unformatted=$$("$$($(GO) env GOROOT)/bin/gofmt" -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go' -not -path './build/*')); \
	if [ -n "$$unformatted" ]; then echo "gofmt: not formatted:" $$unformatted; exit 1; fi
	@$(MAKE) --no-print-directory unit-root unit-kube unit-hook

.PHONY: unit-root unit-kube unit-hook
unit-root:
	$(GO) vet ./...
	$(GO) run $(STATICCHECK) ./...
	$(GO) test -race -count=1 ./...
unit-kube:
	cd kube && $(GO) vet ./...
	cd kube && $(GO) run $(STATICCHECK) ./...
	cd kube && $(GO) test -race -count=1 ./...
unit-hook:
	cd kube/kubevirthook && $(GO) vet ./...
	cd kube/kubevirthook && $(GO) run $(STATICCHECK) ./...
	cd kube/kubevirthook && $(GO) test -race -count=1 ./...

# qemu-test boots the real initramfs on Debian's kernels under QEMU (see qemu-tests/).
# The timeout catches a hang, not a slow suite: cold, with the control plane compiled
# beside it, the suite has taken 22 minutes before the handoff and emergency-shell boots
# were added, and one such run (a busy machine) passed 25 minutes.
# QEMU_SKIP leaves out the tests it matches (go test -skip): make test runs those
# (QEMU_EARLY) beside the unit phase.
QEMU_SKIP ?=
qemu-test: deps
	@for k in $(QEMU_KERNELS); do $(MAKE) --no-print-directory initramfs KERNEL=$$k || exit 1; done
	PASSAGE_BUILD=$(abspath $(BUILD)) PASSAGE_KERNEL=$(KERNEL) $(GO) test -count=1 -timeout 40m -tags qemu -v $(if $(QEMU_SKIP),-skip '$(QEMU_SKIP)') ./qemu-tests/

# qemu-bench times the boot's modules stage on each kernel the suite boots (three boots
# each): the table goes to $(BUILD)/qemu-bench.txt.
qemu-bench: deps
	@for k in $(QEMU_KERNELS); do $(MAKE) --no-print-directory initramfs KERNEL=$$k || exit 1; done
	PASSAGE_BUILD=$(abspath $(BUILD)) $(GO) test -count=1 -timeout 20m -tags qemu -run '^$$' -bench ModulesStage -benchtime 3x ./qemu-tests/ | tee $(BUILD)/qemu-bench.txt

# turnaround-bench times a released unit's way back on the control plane cluster-test
# runs (kube/harness BenchmarkTurnaround): RELEASES releases one at a time (default 40),
# p50 and p99 of pod deletion to the unit allocated again and of each recycle step (erase,
# reset, sign, attest, verify, publish). FORMAT is the simulated NVMe's latency per admin
# command (default none: the erase's own cost is then the simulator's). Not part of test
# or bench; the table goes to $(BUILD)/turnaround-bench.txt.
.PHONY: turnaround-bench
RELEASES ?= 40
FORMAT ?=
turnaround-bench: cluster-bin
	cd kube && PASSAGE_CONTROL_PLANE=$$(bash harness/build.sh $(abspath $(BUILD))/controlplane) PASSAGE_TURN_FORMAT=$(FORMAT) \
		$(GO) test -count=1 -tags cluster -timeout 30m -run '^$$' -bench Turnaround -benchtime $(RELEASES)x ./harness/ | tee $(abspath $(BUILD))/turnaround-bench.txt

# cluster-test runs passage-dra against a real control plane on loopback (kube/harness):
# kube-apiserver, kube-scheduler, kube-controller-manager and etcd at the versions
# kube/harness/kubernetes and kube/harness/etcd pin, built from the Go module proxy into
# $(BUILD)/controlplane/<versions>/ once (cold: about 10 minutes on 2 idle cores, less
# when kube's packages are already compiled: build.sh); afterwards the binaries are reused and the test takes about 30 s).
cluster-bin:
	@bash kube/harness/build.sh $(abspath $(BUILD))/controlplane >/dev/null

cluster-test: cluster-bin
	cd kube && $(GO) vet -tags cluster ./harness/
	cd kube && PASSAGE_CONTROL_PLANE=$$(bash harness/build.sh $(abspath $(BUILD))/controlplane) \
		$(GO) test -count=1 -tags cluster -timeout 15m -v -run TestCluster ./harness/

# storm-bench is the boot storm (kube/harness BenchmarkBootStorm): NODES soft-TPM nodes
# (default 1000,5000,10000; a comma list runs each) enrolling and attesting at once, then
# rebooting at once, against two passage-control replicas on the control plane
# cluster-test runs, and the floor that API server sustains. Not part of test or
# bench (it needs that control plane and minutes); the table goes to
# $(BUILD)/storm-bench.txt.
NODES ?= 1000,5000,10000
storm-bench: cluster-bin
	cd kube && PASSAGE_CONTROL_PLANE=$$(bash harness/build.sh $(abspath $(BUILD))/controlplane) PASSAGE_STORM_NODES=$(NODES) \
		$(GO) test -count=1 -tags cluster -timeout 120m -run '^$$' -bench BootStorm -benchtime 1x ./harness/ | tee $(abspath $(BUILD))/storm-bench.txt

# images writes the Kubernetes side's container images with no container daemon
# (kube/images, on go-containerregistry): passage-dra built with cgo (it dlopens
# libnvfm) on a glibc base of Debian packages, the ones kube/images/glibc-base names and
# says why, downloaded into $(IMAGES)/debs unless there at the archive's version;
# passage-control and passage-hook static (CGO_ENABLED=0) on no base; and the images the
# real node test runs that passage does not ship (kube/images Node): pause, the pods'
# sandbox, and vfio-probe, static. Each image is an OCI image layout, $(IMAGES)/NAME,
# the same layout as one tar for ctr images import, $(IMAGES)/NAME.oci.tar, named
# $(REGISTRY)/NAME:latest in it, and its manifest's digest in $(IMAGES)/NAME.digest; the
# base's packages and their sha256 in $(IMAGES)/debs.lock (and the image's labels). The
# same commit and the same packages give the same digests: -trimpath and -buildvcs=false
# keep the build's directory and the work tree's state out of the binaries (-s -w: no
# symbol table or DWARF, a third of passage-dra; Go's stack traces do not use them), and
# every time in an image is the commit's (SOURCE_DATE_EPOCH) or the package's own.
# Not part of test; kube/images's tests build and run an image themselves.
.PHONY: images
IMAGES := $(BUILD)/images
REGISTRY ?= passage.test
IMAGE_GOFLAGS := -trimpath -buildvcs=false -ldflags='-s -w'
images:
	@mkdir -p $(IMAGES)/bin
	cd kube && CGO_ENABLED=1 $(GO) build $(IMAGE_GOFLAGS) -o $(abspath $(IMAGES))/bin/ ./cmd/passage-dra
	cd kube && CGO_ENABLED=0 $(GO) build $(IMAGE_GOFLAGS) -o $(abspath $(IMAGES))/bin/ ./cmd/passage-control ./images/pause ./images/vfio-probe
	cd kube/kubevirthook && CGO_ENABLED=0 $(GO) build $(IMAGE_GOFLAGS) -o $(abspath $(IMAGES))/bin/ ./cmd/passage-hook
	@debs=$$(bash kube/images/debs.sh $(abspath $(IMAGES))/debs $$(grep -v '^#' kube/images/glibc-base)) || exit 1; \
	export SOURCE_DATE_EPOCH=$${SOURCE_DATE_EPOCH:-$$(git log -1 --format=%ct)}; \
	cd kube && $(GO) run ./cmd/passage-images -bin $(abspath $(IMAGES))/bin -out $(abspath $(IMAGES)) -registry $(REGISTRY) \
		-source https://github.com/passage-boot/passage -revision "$$(git rev-parse HEAD)" -version "$$(git describe --tags --always --dirty)" $$debs

# node-bin builds what the real node (the QEMU guest that runs containerd and a kubelet
# against the control plane) needs that its root file system does not have: the kubelet
# (with the control plane, kube/harness/build.sh), containerd, its runc shim, ctr, runc
# and the CNI plugins (kube/harness/noderuntime/build.sh), all static, and the images
# (make images: the .oci.tar files containerd imports). Each script reuses a finished
# build; kube/harness/README.md, "The node's programs", has the versions, sizes and times.
.PHONY: node-bin
node-bin: deps images
	@cp=$$(bash kube/harness/build.sh $(abspath $(BUILD))/controlplane) || exit 1; \
	rt=$$(bash kube/harness/noderuntime/build.sh $(abspath $(BUILD))/noderuntime) || exit 1; \
	echo "node-bin: kubelet           $$cp/kubelet"; \
	echo "node-bin: containerd, containerd-shim-runc-v2, ctr, runc, CNI plugins (ptp bridge host-local loopback portmap)"; \
	echo "node-bin:                   $$rt/"; \
	echo "node-bin: images            $(abspath $(IMAGES))/{pause,vfio-probe,passage-dra,passage-control,passage-hook}.oci.tar"

# node-import-test imports each image's .oci.tar with the node's own containerd and ctr
# (kube/images TestContainerdImports, tag node): containerd as root for the import only,
# in temporary directories and a mount namespace of its own; no container is started.
.PHONY: node-import-test
node-import-test: node-bin
	cd kube && PASSAGE_NODE_RUNTIME=$$(bash harness/noderuntime/build.sh $(abspath $(BUILD))/noderuntime) PASSAGE_BUILD=$(abspath $(BUILD)) \
		$(GO) test -count=1 -tags node -v -run TestContainerdImports ./images/

# node-test is the real node (kube/harness TestRealNode, tags cluster and node): a QEMU
# guest booted through passage's initramfs hands off by switch_root to a root running
# containerd, runc, the CNI plugins and the kubelet (make node-bin), which joins the
# control plane on the host; the shipped kustomization runs passage-dra on it and a pod
# gets its unit. CGO_ENABLED=0: kustomize links Go's plugin package, whose loader would
# resolve go-nvfm's deliberately unresolved symbols at start; nothing here needs cgo.
# NODE_CONSOLE keeps the guest's console (the test's directory goes when it ends).
.PHONY: node-test
NODE_CONSOLE ?= $(abspath $(BUILD))/realnode-console.log
node-test: node-bin
	@$(MAKE) --no-print-directory initramfs KERNEL=$(KERNEL)
	cd kube && CGO_ENABLED=0 PASSAGE_CONTROL_PLANE=$$(bash harness/build.sh $(abspath $(BUILD))/controlplane) \
		PASSAGE_NODE_RUNTIME=$$(bash harness/noderuntime/build.sh $(abspath $(BUILD))/noderuntime) \
		PASSAGE_IMAGES=$(abspath $(IMAGES)) PASSAGE_BUILD=$(abspath $(BUILD))/linux-$(KERNEL) PASSAGE_NODE_CONSOLE=$(NODE_CONSOLE) \
		$(GO) test -count=1 -tags cluster,node -timeout 20m -v -run TestRealNode ./harness/

# test: the unit phase; beside it, at idle priority (SCHED_IDLE, chrt --idle: CPU time
# nothing else wants), the initramfs images and the control plane's build, since the
# unit phase leaves about a third of the two cores idle (warm, 751 s of CPU in 598 s,
# 7 Dec). Once the default kernel's image is built, the QEMU tests in QEMU_EARLY run
# there too, at idle priority: the guests that only boot a rendered domain and run
# `passage plan` inside it (no deadline of their own but the harness's 9 minutes), which
# were the suite's parallel tail (160 s of its 1,224 s, 8 Dec). When the unit phase ends
# whatever of them is left is raised to nice 10 (every thread: chrt --other, renice),
# so it does not starve beside the suite. (The real node there instead, at nice 10, took
# a core from the race tests: unit phase 806 s, make test 2030 s, 8 Dec; with these
# guests at idle priority, 676 s and 1706 s.) Then the QEMU suite, whose serial tests
# run one TCG guest (one host thread), with the cluster tests and the real node beside
# it, side by side, at nice 10: the cluster tests mostly wait on their API server (212 s
# of CPU in 310 s, 7 Dec), the real node is one more TCG guest, and one after the other
# they were make test's longest chain (1,094 s after the unit phase). SCHED_IDLE would
# starve them, and their waits time out. They start only once the unit phase is done:
# beside the race tests the cluster tests starved. A cold control plane build (some 18
# minutes of CPU) goes on into the QEMU phase, and they wait for it. The side chain's
# output goes to $(BUILD)/controlplane-build.log and $(BUILD)/cluster-test.log, the
# early QEMU tests' to $(BUILD)/qemu-early.log, each printed when the suite ends; if any
# part fails, test fails.
QEMU_EARLY := ^(TestLargeBARGuests|TestRenderedGuestsStart)$$
test: deps
	@t0=$$SECONDS; mkdir -p $(BUILD); rm -f $(BUILD)/unit.done $(BUILD)/initramfs-*.done; \
	setsid bash -c 'for k in $(QEMU_KERNELS); do chrt --idle 0 $(MAKE) --no-print-directory initramfs KERNEL=$$k || { touch $(BUILD)/initramfs-failed.done; exit 2; }; touch $(BUILD)/initramfs-$$k.done; done' \
		>$(BUILD)/prebuild.log 2>&1 & pre=$$!; \
	setsid bash -c 'while [ ! -e $(BUILD)/initramfs-$(KERNEL).done ]; do [ -e $(BUILD)/initramfs-failed.done ] && exit 2; sleep 2; done; s=$$SECONDS; \
		PASSAGE_BUILD=$(abspath $(BUILD)) PASSAGE_KERNEL=$(KERNEL) chrt --idle 0 $(GO) test -count=1 -timeout 40m -tags qemu -v -run "$(QEMU_EARLY)" ./qemu-tests/; r=$$?; \
		echo "test: the QEMU tests $(QEMU_EARLY) (at idle priority beside the unit phase, then nice 10) took $$((SECONDS - s)) s"; exit $$r' \
		>$(BUILD)/qemu-early.log 2>&1 & early=$$!; \
	setsid bash -c 's=$$SECONDS; chrt --idle 0 bash kube/harness/build.sh $(abspath $(BUILD))/controlplane >$(BUILD)/controlplane-build.log 2>&1 || exit 3; \
		echo "test: the control plane built (at idle priority) after $$((SECONDS - s)) s"; \
		while [ ! -e $(BUILD)/unit.done ]; do sleep 2; done; \
		s=$$SECONDS; ( nice -n 10 $(MAKE) --no-print-directory cluster-test; r=$$?; \
			echo "test: cluster tests (at nice 10, beside the QEMU suite and the real node) took $$((SECONDS - s)) s"; exit $$r ) >$(BUILD)/cluster-only.log 2>&1 & ct=$$!; \
		n=$$SECONDS; chrt --idle 0 $(MAKE) --no-print-directory node-bin >$(BUILD)/node-bin.log 2>&1 || { cat $(BUILD)/node-bin.log; kill $$ct; exit 5; }; \
		echo "test: the real node programs and images built (at idle priority) in $$((SECONDS - n)) s; the real node:"; \
		n=$$SECONDS; nice -n 10 $(MAKE) --no-print-directory node-test; rc=$$?; \
		echo "test: the real node (at nice 10, beside the QEMU suite and the cluster tests) took $$((SECONDS - n)) s"; \
		wait $$ct; crc=$$?; cat $(BUILD)/cluster-only.log; [ $$crc = 0 ] || exit 4; [ $$rc = 0 ] || exit 6' >$(BUILD)/cluster-test.log 2>&1 & side=$$!; \
	trap 'kill -- -$$pre -$$side -$$early 2>/dev/null' EXIT; \
	$(MAKE) --no-print-directory unit || exit 1; \
	touch $(BUILD)/unit.done; \
	for p in $$(pgrep -s $$early); do for t in /proc/$$p/task/*; do chrt --other -p 0 $${t##*/} && renice -n 10 -p $${t##*/}; done; done >/dev/null 2>&1; \
	echo "test: unit phase (gofmt, vet, staticcheck, race unit tests of the three modules) took $$((SECONDS - t0)) s"; \
	t1=$$SECONDS; wait $$pre || { echo "test: the initramfs build failed:"; cat $(BUILD)/prebuild.log; exit 1; }; \
	echo "test: the initramfs images (built at idle priority beside the unit phase) were ready $$((SECONDS - t1)) s after it"; \
	$(MAKE) --no-print-directory qemu-test QEMU_SKIP='$(QEMU_EARLY)' || exit 1; \
	wait $$early; erc=$$?; cat $(BUILD)/qemu-early.log; [ $$erc = 0 ] || { echo "test: the QEMU tests $(QEMU_EARLY) failed"; exit 1; }; \
	echo "test: QEMU phase (the suite) took $$((SECONDS - t1)) s"; \
	start=$$SECONDS; echo "test: waiting for the control plane's build, the cluster tests and the real node"; \
	wait $$side; rc=$$?; trap - EXIT; \
	if [ $$rc = 3 ]; then echo "test: the control plane's build failed:"; cat $(BUILD)/controlplane-build.log; exit 1; fi; \
	cat $(BUILD)/cluster-test.log; \
	if [ $$rc != 0 ]; then echo "test: the cluster tests or the real node failed (exit $$rc)"; exit 1; fi; \
	echo "test: they ended $$((SECONDS - start)) s after the QEMU phase; make test took $$((SECONDS - t0)) s"

demo: initramfs
	@bash image/demo.sh $(IMAGE)

# bench prints the performance table and writes it, with the details behind it, to
# $(BUILD)/bench.md (never to a tracked file).
bench: deps
	@BUILD=$(BUILD) IMAGE=$(IMAGE) bash bench/run.sh

clean:
	rm -rf $(BUILD)
