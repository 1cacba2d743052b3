package kubevirthook

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"
	"runtime/debug"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	hooksinfo "kubevirt.io/kubevirt/pkg/hooks/info"
	hooksv1alpha3 "kubevirt.io/kubevirt/pkg/hooks/v1alpha3"

	"github.com/passage-boot/passage/manifest"
)

// Name is the hook's name in Info, what a VMI's hooks.kubevirt.io/hookSidecars
// annotation and virt-launcher's logs show.
const Name = "passage-unit-switch"

// Server answers virt-launcher's hook calls (KubeVirt v1.9: Info, then the v1alpha3
// Callbacks) with KubeVirt's own generated gRPC types.
type Server struct {
	Config Config
	// NCCLDir, when set, receives the guest's NCCL topology file of each VMI defined
	// with passage units, <namespace>_<name>.nccl-topo.xml (fileStem: a long name is
	// cut and hashed), rewritten at each call so it is the one of the domain last
	// handed back.
	NCCLDir string
	// NCCLDiskDir is NCCLDir as virt-launcher's compute container (libvirt, QEMU) sees
	// it: KubeVirt mounts the Nth sidecar's /var/run/kubevirt-hooks there at
	// /var/run/kubevirt-hooks/hook-sidecar-N. When set (with NCCLDir), the guest gets
	// the NCCL file as a CD-ROM, <namespace>_<name>.nccl-topo.img.
	NCCLDiskDir string
	Log         *log.Logger
}

// Info subscribes to OnDefineDomain at v1alpha3, the version v1.9's virt-launcher tries
// first.
func (s *Server) Info(context.Context, *hooksinfo.InfoParams) (*hooksinfo.InfoResult, error) {
	return &hooksinfo.InfoResult{Name: Name, Versions: []string{hooksv1alpha3.Version},
		HookPoints: []*hooksinfo.HookPoint{{Name: hooksinfo.OnDefineDomainHookPointName, Priority: 0}}}, nil
}

// OnDefineDomain rebuilds the domain's passage units (DefineDomain); a refusal is a gRPC
// error, which virt-launcher turns into a failed VMI start.
func (s *Server) OnDefineDomain(_ context.Context, p *hooksv1alpha3.OnDefineDomainParams) (*hooksv1alpha3.OnDefineDomainResult, error) {
	vmi := vmiName(p.GetVmi())
	stem := fileStem(vmi)
	c := s.Config
	if s.NCCLDir != "" && s.NCCLDiskDir != "" {
		c.NCCLDisk = filepath.Join(s.NCCLDiskDir, stem+".nccl-topo.img")
	}
	r, err := c.DefineDomain(p.GetDomainXML())
	if err != nil {
		s.logf("%s: refused: %v", vmi, err)
		return nil, status.Errorf(codes.FailedPrecondition, "passage: VMI %s: %v", vmi, err)
	}
	if r.Guest == nil {
		s.logf("%s: no passage unit function: domain unchanged", vmi)
		return &hooksv1alpha3.OnDefineDomainResult{DomainXML: r.Domain}, nil
	}
	s.logf("%s: %d units behind their switches", vmi, len(r.Guest.Units))
	if s.NCCLDir != "" {
		name := stem + ".nccl-topo.xml"
		if err := manifest.WriteAtomic(s.NCCLDir, name, r.NCCL); err != nil {
			return nil, status.Errorf(codes.Internal, "passage: VMI %s: nccl topology: %v", vmi, err)
		}
		if c.NCCLDisk != "" {
			// Written before the domain is handed back: libvirt opens it at start.
			img, err := NCCLImage(r.NCCL)
			if err == nil {
				err = manifest.WriteAtomic(s.NCCLDir, filepath.Base(c.NCCLDisk), img)
			}
			if err != nil {
				return nil, status.Errorf(codes.Internal, "passage: VMI %s: nccl disk: %v", vmi, err)
			}
		}
	}
	return &hooksv1alpha3.OnDefineDomainResult{DomainXML: r.Domain}, nil
}

// PreCloudInitIso passes cloud-init data through (Info does not subscribe to it).
func (s *Server) PreCloudInitIso(_ context.Context, p *hooksv1alpha3.PreCloudInitIsoParams) (*hooksv1alpha3.PreCloudInitIsoResult, error) {
	return &hooksv1alpha3.PreCloudInitIsoResult{CloudInitNoCloudSource: p.GetCloudInitNoCloudSource(), CloudInitData: p.GetCloudInitData()}, nil
}

// Shutdown has nothing to undo.
func (s *Server) Shutdown(context.Context, *hooksv1alpha3.ShutdownParams) (*hooksv1alpha3.ShutdownResult, error) {
	return &hooksv1alpha3.ShutdownResult{}, nil
}

func (s *Server) logf(format string, a ...any) {
	if s.Log != nil {
		s.Log.Printf(format, a...)
	}
}

// vmiName is <namespace>_<name> of the VMI JSON virt-launcher passes ("vmi" if unread).
func vmiName(b []byte) string {
	var v struct {
		Metadata struct{ Name, Namespace string }
	}
	if json.Unmarshal(b, &v) != nil || v.Metadata.Name == "" || !safe(v.Metadata.Name) || !safe(v.Metadata.Namespace) {
		return "vmi"
	}
	return v.Metadata.Namespace + "_" + v.Metadata.Name
}

// maxStem bounds the part of a file name taken from a VMI's <namespace>_<name>: a
// namespace is up to 63 characters and a name up to 253, and with the suffixes and
// WriteAtomic's temporary ".<name>.tmp<digits>" the whole must stay within Linux's
// NAME_MAX (255 bytes, include/uapi/linux/limits.h).
const maxStem = 128

// fileStem is vmi as a file name stem: itself when it fits maxStem, else its first 64
// characters, "~" (never in a Kubernetes name, so no plain stem is one of these) and 128
// bits of its SHA-256, which tells two long names apart.
func fileStem(vmi string) string {
	if len(vmi) <= maxStem {
		return vmi
	}
	sum := sha256.Sum256([]byte(vmi))
	return vmi[:64] + "~" + hex.EncodeToString(sum[:16])
}

// safe: a Kubernetes name (DNS label/subdomain characters), never a path.
func safe(s string) bool {
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-' || r == '.') {
			return false
		}
	}
	return s != "." && s != ".."
}

// Serve listens on the unix socket path (virt-launcher looks one directory below
// /var/run/kubevirt-hooks) until ctx ends.
func Serve(ctx context.Context, path string, s *Server) error {
	return serve(ctx, path, s, s, s.Log)
}

// serve is Serve with the two services apart, so a test can stand a handler that
// panics behind the same server.
func serve(ctx context.Context, path string, info hooksinfo.InfoServer, cb hooksv1alpha3.CallbacksServer, l *log.Logger) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("socket %s: %w", path, err)
	}
	// The socket is bound under a temporary name and renamed into place once it
	// listens: virt-launcher (and a test) dial whatever socket appears in the directory,
	// and a path that exists between bind and listen refuses the connection.
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	if err := os.Remove(tmp); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("socket %s: %w", tmp, err)
	}
	ln, err := net.Listen("unix", tmp)
	if err != nil {
		return fmt.Errorf("socket %s: %w", path, err)
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	if err := os.Rename(tmp, path); err != nil {
		ln.Close()
		os.Remove(tmp)
		return fmt.Errorf("socket %s: %w", path, err)
	}
	defer os.Remove(path)
	g := grpc.NewServer(grpc.ChainUnaryInterceptor(recoverPanic(l)))
	hooksinfo.RegisterInfoServer(g, info)
	hooksv1alpha3.RegisterCallbacksServer(g, cb)
	go func() {
		<-ctx.Done()
		g.Stop()
	}()
	if err := g.Serve(ln); err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}

// recoverPanic turns a handler's panic into a refused call, its stack in the log: gRPC
// runs each call on a goroutine of its own, where a panic would end the whole sidecar
// and with it every VM start on the node, not the one call.
func recoverPanic(l *log.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
		defer func() {
			if r := recover(); r != nil {
				if l != nil {
					l.Printf("%s: panic (a bug; the call is refused): %v\n%s", info.FullMethod, r, debug.Stack())
				}
				resp, err = nil, status.Errorf(codes.Internal, "passage: %s: internal error, refused (the hook's log has its stack): %v", info.FullMethod, r)
			}
		}()
		return handler(ctx, req)
	}
}
