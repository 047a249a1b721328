#!/usr/bin/env bash
# Deploy tgis with a model: put the model on the tgis-models PVC, then apply a kustomization.
#
#   deployment/deploy_model.sh [options] MODEL
#
# MODEL is a local model directory (config.json, tokenizer files, *.safetensors), streamed to
# the PVC as <name>/, or a Hugging Face Hub id (org/name) that a helper pod downloads there
# with `text-generation-server download-weights` (the cluster needs access to the Hub; set
# HF_TOKEN for gated models). The server then runs with MODEL_NAME=/mnt/models/<name>
# (KServe: storageUri pvc://tgis-models/<name>).
#
# Options:
#   -o, --overlay NAME  what to apply: an overlay of deployment/overlays (default gpu-1),
#                       base (CPU only) or kserve (ServingRuntime + InferenceService)
#   -n, --namespace NS  namespace, created if missing (default tgis)
#   -i, --image REF     the tgis image built from Dockerfile.ubi (default: the kustomization's)
#   --name NAME         directory on the PVC (default: the directory's name, or org--name)
#   --fs-group GID      fsGroup of the copy pod, where the cluster sets none (not OpenShift)
#   --skip-copy         the model is already on the PVC under NAME
#   --dry-run           print the rendered manifests and the steps; change nothing
#   -h, --help
# Env: KUBECTL (default kubectl; oc works too).
set -euo pipefail

deploy_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
kubectl="${KUBECTL:-kubectl}"
overlay=gpu-1
namespace=tgis
image=""
name=""
fs_group=""
skip_copy=false
dry_run=false
copy_pod=tgis-model-copy

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }
die() { echo "deploy_model.sh: $*" >&2; exit 1; }
step() { echo "==> $*" >&2; }

while [ $# -gt 0 ]; do
    case "$1" in
        -o | --overlay) overlay="${2:?}"; shift 2 ;;
        -n | --namespace) namespace="${2:?}"; shift 2 ;;
        -i | --image) image="${2:?}"; shift 2 ;;
        --name) name="${2:?}"; shift 2 ;;
        --fs-group) fs_group="${2:?}"; shift 2 ;;
        --skip-copy) skip_copy=true; shift ;;
        --dry-run) dry_run=true; shift ;;
        -h | --help) usage; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done
[ $# -eq 1 ] || die "expected one MODEL argument (see --help)"
model="$1"

case "$overlay" in
    base | kserve) source_dir="$overlay" ;;
    *) source_dir="overlays/$overlay" ;;
esac
[ -f "$deploy_dir/$source_dir/kustomization.yaml" ] || die "no kustomization for '$overlay'"

if [ -d "$model" ]; then
    kind=directory
    [ -f "$model/config.json" ] || die "$model has no config.json"
    model_dir="$(cd "$model" && pwd)"
    default_name="$(basename "$model_dir")"
elif [[ "$model" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$ ]]; then
    kind=hub
    default_name="${model//\//--}"
else
    die "$model is neither a directory nor a Hugging Face Hub id"
fi
name="${name:-$default_name}"
[[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || die "invalid --name '$name'"
[[ "$namespace" =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]] || die "invalid namespace '$namespace'"

# Render: a kustomization next to the others (kustomize refuses absolute paths) that sets the
# namespace, the model and the image.
work="$(mktemp -d "$deploy_dir/.deploy.XXXXXX")"
cleanup() {
    if [ "$dry_run" = false ] && [ -n "${copy_pod_created:-}" ]; then
        "$kubectl" delete pod "$copy_pod" -n "$namespace" --ignore-not-found --wait=false >&2 || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

image_patches=""
if [ -n "$image" ]; then
    image_patches="
  - target: {kind: Deployment, name: tgis}
    patch: '[{\"op\": \"replace\", \"path\": \"/spec/template/spec/containers/0/image\", \"value\": \"$image\"}]'
  - target: {kind: ServingRuntime}
    patch: '[{\"op\": \"replace\", \"path\": \"/spec/containers/0/image\", \"value\": \"$image\"}]'"
fi
cat > "$work/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: $namespace
resources:
  - ../$source_dir
patches:
  - target: {kind: Deployment, name: tgis}
    patch: |-
      apiVersion: apps/v1
      kind: Deployment
      metadata: {name: tgis}
      spec:
        template:
          spec:
            containers:
              - name: server
                env:
                  - {name: MODEL_NAME, value: /mnt/models/$name}
  - target: {kind: InferenceService}
    patch: '[{"op": "replace", "path": "/spec/predictor/model/storageUri", "value": "pvc://tgis-models/$name"}]'$image_patches
EOF
"$kubectl" kustomize "$work" > "$work/rendered.yaml"
if [ -z "$image" ]; then
    image="$(sed -n 's/^ *image: *//p' "$work/rendered.yaml" | head -n 1)"
fi

if [ "$dry_run" = true ]; then
    if [ "$skip_copy" = false ]; then
        step "would create PVC tgis-models in namespace $namespace and, in pod $copy_pod ($image),"
        if [ "$kind" = directory ]; then
            step "copy $model_dir to tgis-models:/$name"
        else
            step "download $model (text-generation-server download-weights) to tgis-models:/$name"
        fi
    fi
    step "would apply these manifests (deployment/$source_dir, model /mnt/models/$name):"
    cat "$work/rendered.yaml"
    exit 0
fi

if ! "$kubectl" get namespace "$namespace" > /dev/null 2>&1; then
    step "creating namespace $namespace"
    "$kubectl" create namespace "$namespace" >&2
fi

in_pod() { "$kubectl" exec -i -n "$namespace" "$copy_pod" -- "$@"; }

if [ "$skip_copy" = false ]; then
    step "PVC tgis-models"
    "$kubectl" apply -n "$namespace" -f "$work/rendered.yaml" \
        -l app.kubernetes.io/component=model-storage >&2
    step "starting pod $copy_pod ($image)"
    fs_group_field=""
    [ -z "$fs_group" ] || fs_group_field=", fsGroup: $fs_group"
    copy_pod_created=1
    "$kubectl" apply -n "$namespace" -f - >&2 <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $copy_pod
  labels: {app.kubernetes.io/name: tgis, app.kubernetes.io/component: model-copy}
spec:
  restartPolicy: Never
  securityContext: {runAsNonRoot: true, seccompProfile: {type: RuntimeDefault}$fs_group_field}
  containers:
    - name: copy
      image: $image
      command: [sleep, "7200"]
      env:
        - {name: HF_HUB_OFFLINE, value: "0"}
        - {name: HF_HUB_CACHE, value: /mnt/models/.hub}
      securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
      volumeMounts:
        - {name: models, mountPath: /mnt/models}
        - {name: tmp, mountPath: /tmp}
  volumes:
    - {name: models, persistentVolumeClaim: {claimName: tgis-models}}
    - {name: tmp, emptyDir: {}}
EOF
    "$kubectl" wait -n "$namespace" --for=condition=Ready "pod/$copy_pod" --timeout=15m >&2
    incoming="/mnt/models/.incoming-$name"
    in_pod rm -rf "$incoming"
    in_pod mkdir -p "$incoming"
    if [ "$kind" = directory ]; then
        step "copying $model_dir to tgis-models:/$name"
        # -h: store the files symbolic links point at (an HF cache snapshot is all links).
        tar -chf - -C "$model_dir" . | in_pod tar -xf - -C "$incoming"
    else
        step "downloading $model to tgis-models:/$name"
        in_pod env HF_TOKEN="${HF_TOKEN:-}" text-generation-server download-weights "$model"
        # shellcheck disable=SC2016  # expanded by the pod's shell
        in_pod sh -c 'snapshot="$(ls -d /mnt/models/.hub/models--"$1"/snapshots/* | head -n 1)" &&
            cp -RL "$snapshot"/. "$2"/ && rm -rf /mnt/models/.hub' sh "${model//\//--}" "$incoming"
    fi
    # shellcheck disable=SC2016
    in_pod sh -c 'rm -rf "$2" && mv "$1" "$2"' sh "$incoming" "/mnt/models/$name"
    "$kubectl" delete pod -n "$namespace" "$copy_pod" --wait=true >&2
    copy_pod_created=""
fi

step "applying deployment/$source_dir to namespace $namespace"
"$kubectl" apply -n "$namespace" -f "$work/rendered.yaml" >&2
if grep -q '^kind: InferenceService$' "$work/rendered.yaml"; then
    isvc="$(awk '/^kind: InferenceService$/{f=1} f && /^  name:/{print $2; exit}' "$work/rendered.yaml")"
    "$kubectl" wait -n "$namespace" --for=condition=Ready "inferenceservice/$isvc" --timeout=30m >&2
    step "ready: kubectl port-forward -n $namespace deploy/$isvc-predictor 8033 (RawDeployment)"
else
    "$kubectl" rollout status -n "$namespace" deployment/tgis --timeout=30m >&2
    step "ready: kubectl port-forward -n $namespace svc/tgis 8033, then grpcurl localhost:8033"
fi
