package harness

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// The client CA's files in the cluster's directory (Options.Signing): kube-apiserver
// authenticates client certificates chained to it (--client-ca-file), and
// kube-controller-manager's csrsigning controller signs approved requests with it.
const (
	ClientCACert = "client-ca.crt"
	ClientCAKey  = "client-ca.key"
)

// SigningController is kube-controller-manager's csrsigning controller's name in
// --controllers (k8s.io/kubernetes cmd/kube-controller-manager/names). Its approving
// controller, certificatesigningrequest-approving-controller, is not run: no request is
// approved by anyone but passage-control.
const SigningController = "certificatesigningrequest-signing-controller"

// clientCA writes a throw-away client CA (ECDSA P-256) to dir.
func clientCA(dir string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "passage-e2e-client-ca"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return err
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	for name, b := range map[string][]byte{
		ClientCACert: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		ClientCAKey:  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}),
	} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			return err
		}
	}
	return nil
}

// signingAPIServerFlags are kube-apiserver's flags for Options.Signing: client
// certificates of the client CA, and bootstrap tokens (Secrets of type
// bootstrap.kubernetes.io/token in kube-system).
func signingAPIServerFlags(dir string) []string {
	return []string{"--client-ca-file=" + filepath.Join(dir, ClientCACert), "--enable-bootstrap-token-auth"}
}

// signing readies a started API server for the kubelet's TLS bootstrap and returns
// kube-controller-manager's controllers and flags with the signer's: a bootstrap token
// (Cluster.BootstrapToken) whose user may create certificate requests
// (system:node-bootstrapper bound to system:bootstrappers, as kubeadm binds it) and
// nothing more (no nodeclient: an approver that judges by RBAC would not approve for
// it), and the signing controller's role for kube-controller-manager's user: read the
// requests, write their status, sign for the kubelet client signer. It returns once the
// token authenticates.
func (c *Cluster) signing(ctx context.Context, controllers string, cmArgs []string) (string, []string, error) {
	id, secret := randomLower(6), randomLower(16)
	tok := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "bootstrap-token-" + id, Namespace: metav1.NamespaceSystem},
		Type:       corev1.SecretTypeBootstrapToken,
		StringData: map[string]string{"token-id": id, "token-secret": secret, "usage-bootstrap-authentication": "true",
			"expiration": time.Now().Add(24 * time.Hour).UTC().Format(time.RFC3339)},
	}
	// kube-system is the API server's own to make, at its start.
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := c.Client.CoreV1().Secrets(metav1.NamespaceSystem).Create(ctx, tok, metav1.CreateOptions{})
		if err == nil {
			break
		}
		if !apierrors.IsNotFound(err) || time.Now().After(deadline) {
			return "", nil, fmt.Errorf("bootstrap token secret: %w", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	c.BootstrapToken = id + "." + secret
	rbac := c.Client.RbacV1()
	if _, err := rbac.ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "e2e:node-bootstrapper"},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "system:node-bootstrapper"},
		Subjects: []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: "system:bootstrappers"}}}, metav1.CreateOptions{}); err != nil {
		return "", nil, fmt.Errorf("system:node-bootstrapper binding: %w", err)
	}
	signer := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "e2e:csr-signer"}, Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{certificatesv1.GroupName}, Resources: []string{"certificatesigningrequests"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{certificatesv1.GroupName}, Resources: []string{"certificatesigningrequests/status"}, Verbs: []string{"update"}},
		{APIGroups: []string{certificatesv1.GroupName}, Resources: []string{"signers"}, ResourceNames: []string{certificatesv1.KubeAPIServerClientKubeletSignerName}, Verbs: []string{"sign"}},
		{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "patch", "update"}},
	}}
	if _, err := rbac.ClusterRoles().Create(ctx, signer, metav1.CreateOptions{}); err != nil {
		return "", nil, fmt.Errorf("csr signer role: %w", err)
	}
	if _, err := rbac.ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "e2e:csr-signer"},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: signer.Name},
		Subjects: []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: "system:kube-controller-manager"}}}, metav1.CreateOptions{}); err != nil {
		return "", nil, fmt.Errorf("csr signer binding: %w", err)
	}
	// The API server's bootstrap token authenticator reads the Secret through its own
	// informer: the token works once that has seen it.
	bc, err := kubernetes.NewForConfig(c.TokenConfig(c.BootstrapToken))
	if err != nil {
		return "", nil, err
	}
	for {
		r, err := bc.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authnv1.SelfSubjectReview{}, metav1.CreateOptions{})
		if err == nil && r.Status.UserInfo.Username == "system:bootstrap:"+id {
			break
		}
		if time.Now().After(deadline) {
			return "", nil, fmt.Errorf("bootstrap token %s. not authenticated after 30s: %v", id, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	controllers += "," + SigningController
	cmArgs = append(cmArgs, "--cluster-signing-cert-file="+filepath.Join(c.Dir, ClientCACert),
		"--cluster-signing-key-file="+filepath.Join(c.Dir, ClientCAKey))
	return controllers, cmArgs, nil
}

// TokenConfig is a client configuration of the API server with a bearer token alone
// (a bootstrap token: what a kubelet's --bootstrap-kubeconfig holds).
func (c *Cluster) TokenConfig(token string) *rest.Config {
	return &rest.Config{Host: c.Server, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAData: c.caPEM}, QPS: 50, Burst: 100}
}

// CertConfig is a client configuration of the API server authenticating with a
// client certificate and its key (PEM): the kubelet's once its certificate is issued.
func (c *Cluster) CertConfig(certPEM, keyPEM []byte) *rest.Config {
	return &rest.Config{Host: c.Server, TLSClientConfig: rest.TLSClientConfig{CAData: c.caPEM, CertData: certPEM, KeyData: keyPEM}, QPS: 50, Burst: 100}
}

// randomLower is n random characters of [a-z0-9], a bootstrap token's alphabet.
func randomLower(n int) string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, n)
	rand.Read(b)
	var s strings.Builder
	for _, c := range b {
		s.WriteByte(alphabet[int(c)%len(alphabet)])
	}
	return s.String()
}
