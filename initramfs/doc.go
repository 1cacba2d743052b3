// Package initramfs is the PID-1 side of passage: the configuration read from the kernel
// command line, and the handoff that ends every boot (switch_root, power off, a shell, or
// holding). Network bring-up and publishing live in initramfs/netboot, the console
// protocol in initramfs/emit, module loading in initramfs/kmod.
//
// # Kernel command line
//
// Arguments are split the way the kernel splits them (lib/cmdline.c next_arg): double
// quotes group words, and '-' and '_' are equal in names. Arguments after a bare "--"
// belong to init and are ignored. An unknown or malformed passage.* argument never stops
// the boot: it is recorded in Config.Errors (and so in the manifest) and the setting keeps
// its default. A later argument overrides an earlier one.
//
//	argument                  default            meaning
//	passage.profile=NAME|FILE b300               labelling profile: b300, b200, qemu, or /ABSOLUTE/PATH.yaml in the image
//	passage.key=PATH          /etc/passage/key   ed25519 private key file that signs the manifest
//	passage.tpm=on|off|auto   auto               TPM signing + PCR extend; auto uses a TPM when one is present, on fails without one
//	passage.ats=require|prefer prefer            a CX-8 function without ATS: prefer degrades its unit (no DT), require fails it
//	passage.erase=off|auto|require (profile)     erase each unit's NVMe and reset its functions before vfio binding; require fails a unit that was not (b300: require)
//	passage.erase_timeout=DUR 30m                deadline of the erase stage (a sanitize can take minutes)
//	passage.plan=sha256:HEX   —                  digest of the saved plan a signed image carries (make uki PLAN=), with its pci=config_acs=
//	passage.erase_overwrite=on|off off           allow Sanitize overwrite after every other method (hours on a large drive)
//	passage.net=IFACE|auto|off auto              management NIC to bring up with DHCPv4; auto tries every link that stays on a host driver
//	passage.net_timeout=DUR   30s                bound on link-up plus DHCP for the network stage
//	passage.url=URL           (none)             http(s) control plane: GET a nonce, POST the envelope and the attestation, answer its enrolment challenge (428); none skips publish; with passage.net=off only a loopback host (127.0.0.0/8, ::1, localhost)
//	passage.url_insecure=1    (off)              publish to a plain-http passage.url whose host is not loopback (without it: refused; the event logs travel unsigned)
//	passage.publish_for=DUR   (5 tries)          keep trying passage.url for up to DUR (a 503/429's Retry-After waited, each wait jittered) instead of 5 tries; the publish stage's deadline becomes DUR plus one try (10s)
//	passage.push=URL          (none)             Prometheus Pushgateway the manifest's metrics are PUT to, after the manifest; none skips push
//	passage.out=/run|DEV:PATH /run               also copy /run/passage/* into PATH on block device DEV (e.g. /dev/vda1:/passage); the generation counter lives there
//	passage.handoff=MODE      hold               switch_root, poweroff, shell or hold, once the manifest is written
//	passage.root=ROOT         (none)             root to switch_root into, UUID=, LABEL=, PARTUUID= or /dev/... (required by handoff=switch_root)
//	passage.hostname=NAME     (none)             the node's name (RFC 1123 host name, folded to lower case), set before the manifest signs it; before DHCP option 12 (iPXE fills it per machine: ${hostname})
//	passage.rootwait=DUR      30s                how long switch_root waits for the root device to appear
//	passage.rootfstype=FS     (probed)           filesystem of passage.root
//	passage.init=PATH         /sbin/init         program exec'd after switch_root
//	passage.emit=console|off  off                print /run/passage/* on the console after the manifest (the QEMU tests' channel)
//	passage.stage_timeout=DUR 60s                deadline of each stage
//	passage.host_modules=A,B  e1000e,igb         host drivers loaded by the host stage, after vfio binding (empty value: none)
//	passage.log=PATH          /run/passage/log.jsonl  the build, then stage results as JSON lines
//	passage.emergency=hold|shell|reboot|poweroff hold  what a failed boot does instead of its handoff (after the manifest is written)
//	passage.emergency_on=failed|degraded|never never  unit verdicts that also take the emergency action: a failed unit, a failed or degraded one, or none (a boot without a signed manifest, or whose handoff fails, takes it always)
//	passage.debug=on|off      off                every stage's whole error on the console, a waiting stage shown every second; passage.debug alone is on
//
// DUR is a Go duration (30s, 2m). handoff=switch_root without passage.root falls back to
// hold, with an error recorded. The node's name is passage.hostname=, else the name the
// kernel already has (its own hostname= argument), else DHCP option 12 (ChooseHostname);
// when only DHCP can give it, the network stage runs before the manifest, bounded by
// passage.net_timeout. A node with none is signed with an empty hostname, never the
// kernel's "(none)", and its hostname stage says so. /run is made a tmpfs before
// anything is written to /run/passage (SetUpRun), so switch_root hands it to the real
// root. Every console line is also written to /dev/kmsg as
// "passage: ..." (level err for a failed line, warning for a degraded one, debug otherwise), so the
// initramfs's messages reach the booted system's journal.
package initramfs
