# passage: the two commands are `make demo` and `make test` (see README.md).
SHELL := /bin/bash
BUILD := build
GO ?= go

.PHONY: all deps build test unit qemu-test demo kernel initramfs ipxe uki bench fuzz clean

all: build

# deps installs what the commands need from Debian's archive when it is missing.
deps:
	@bash image/deps.sh

build:
	@mkdir -p $(BUILD)
	$(GO) build -o $(BUILD)/passage ./cmd/passage

kernel: deps
	@bash image/kernel.sh $(BUILD)/kernel

initramfs: kernel
	@bash image/initramfs.sh $(BUILD)

ipxe: initramfs
	@bash image/ipxe.sh $(BUILD)

# uki writes $(BUILD)/netboot/passage.efi, the kernel, initramfs and command line as one
# unified kernel image signed for UEFI Secure Boot, and the boot.ipxe that chains it.
# UKI_KEY/UKI_CERT: the operator's db signing key (never one shipped in an image).
UKI_CMDLINE ?= console=ttyS0,115200 intel_iommu=on panic=-1 rdinit=/bbin/passage passage.profile=b300 passage.handoff=switch_root passage.root=LABEL=root
uki: initramfs
	@test -n "$(UKI_KEY)" -a -n "$(UKI_CERT)" || { echo "make uki: set UKI_KEY= and UKI_CERT= (the db key that signs the image)"; exit 2; }
	@bash image/uki.sh $(BUILD)/netboot $(BUILD)/kernel/vmlinuz $(BUILD)/initramfs.cpio.gz "$(UKI_CMDLINE)" "$(UKI_KEY)" "$(UKI_CERT)"

# unit checks formatting, runs vet, staticcheck and the race-enabled unit tests (synthetic
# trees, lspci oracle, TPM simulator). staticcheck runs from its own module at a pinned
# version, so it adds nothing to passage's dependencies.
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2
unit: deps
	@unformatted=$$("$$($(GO) env GOROOT)/bin/gofmt" -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go' -not -path './build/*')); \
	if [ -n "$$unformatted" ]; then echo "gofmt: not formatted:" $$unformatted; exit 1; fi
	$(GO) vet ./...
	$(GO) run $(STATICCHECK) ./...
	$(GO) test -race -count=1 ./...

# qemu-test boots the real initramfs on Debian's kernel under QEMU (see qemu-tests/).
qemu-test: initramfs
	PASSAGE_BUILD=$(abspath $(BUILD)) $(GO) test -count=1 -timeout 25m -tags qemu -v ./qemu-tests/

test: unit qemu-test

demo: initramfs
	@bash image/demo.sh $(BUILD)

# bench prints the performance table and writes it, with the details behind it, to
# $(BUILD)/bench.md (never to a tracked file).
bench: deps
	@BUILD=$(BUILD) bash bench/run.sh

clean:
	rm -rf $(BUILD)
